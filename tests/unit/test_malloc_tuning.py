import subprocess
import sys

from hpctrain import malloc_tuning


def test_child_env_sets_thresholds_unless_user_did():
    env = malloc_tuning.child_env({"PATH": "/bin"})
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(4 << 30) and env["MALLOC_TRIM_THRESHOLD_"] == str(4 << 30)
    mine = malloc_tuning.child_env({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert "MALLOC_MMAP_THRESHOLD_" not in mine and mine["MALLOC_TRIM_THRESHOLD_"] == "0"
    assert "MALLOC_MMAP_THRESHOLD_" not in malloc_tuning.child_env({"HPCTRAIN_MALLOC_TUNING": "0"})


def test_tuning_applies_on_glibc_and_respects_opt_out():
    code = "from hpctrain import malloc_tuning; print(malloc_tuning.tune_this_process())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                        env={"PATH": "/usr/bin:/bin"}).stdout.strip()
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "HPCTRAIN_MALLOC_TUNING": "0"}).stdout.strip()
    assert (on, off) == ("True", "False")
