"""A bad HPCTRAIN_* value never breaks ``import hpctrain``; it stops the job when used (or at
start) with one line naming the variable — in a fresh process, as a user meets it."""
import subprocess
import sys

import pytest

from mpirun import ROOT, mpi_env, python_argv, run_mpi

pytestmark = pytest.mark.mpi


def run(code_or_args, env: dict) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", code_or_args] if isinstance(code_or_args, str) else [sys.executable, *code_or_args]
    return subprocess.run(argv, env=mpi_env(env), cwd=str(ROOT), text=True, capture_output=True, timeout=120)


def test_ring_segment_in_the_readme_notation_imports_and_is_used():
    out = run("import hpctrain.comm, hpctrain.torch\n"
              "from hpctrain.comm import algorithms, mpiring\n"
              "print(algorithms.ring_segment_bytes(), mpiring.segment_bytes())",
              {"HPCTRAIN_RING_SEGMENT_BYTES": "1MiB"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1048576", "1048576"]


def test_a_garbage_ring_segment_imports_and_fails_at_init_naming_the_variable():
    out = run("import hpctrain, hpctrain.comm, hpctrain.torch\nprint('imported', flush=True)\nhpctrain.comm.init()",
              {"HPCTRAIN_RING_SEGMENT_BYTES": "garbage"})
    assert out.stdout.strip() == "imported", out.stderr
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("hpctrain.settings.SettingError: HPCTRAIN_RING_SEGMENT_BYTES='garbage': expected a size"), last


@pytest.mark.parametrize("var,raw", [("STALL_TIMEOUT", "abc"), ("STALL_TIMEOUT", "-5"), ("BACKEND", "bogus"),
                                     ("SHM_SLOT_BYTES", "0"), ("RING_SEGMENT_BYTES", "0")])
def test_the_cli_stops_with_one_line_and_a_hint(var, raw):
    out = run(["-m", "hpctrain.cli.main", "selfcheck"], {"HPCTRAIN_" + var: raw})
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"hpctrain: error: HPCTRAIN_{var}={raw!r}: expected ") and "HINT:" in lines[0]


def test_every_rank_stops_at_start_instead_of_hanging():
    out = run_mpi(2, python_argv("-m", "hpctrain.cli.main", "selfcheck"), timeout=120,
                  env={"HPCTRAIN_STALL_TIMEOUT": "abc"})
    assert out.returncode not in (0, -9), out.stdout
    assert "Traceback" not in out.stdout
    # every rank stops on its own (no collective to wait in); Open MPI may end the second rank
    # before it prints, once the first has exited non-zero
    assert out.stdout.count("hpctrain: error: HPCTRAIN_STALL_TIMEOUT='abc': expected a number of seconds") >= 1
