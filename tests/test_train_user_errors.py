"""`hpctrain train` / `hpctrain launch` driven from outside with a user's mistakes: each ends
in one error with a HINT and exit code 2 (no traceback), `--dry-run` finds the same ones,
and SIGTERM to the launcher stops the run like SIGTERM to a rank."""
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import clirun
from mpirun import ROOT, mpi_env, python_argv, run_mpi

pytestmark = pytest.mark.mpi

HPCTRAIN = python_argv("-m", "hpctrain.cli.main")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from hpctrain.data.pack import pack
    from sklearn.datasets import load_digits

    base = tmp_path_factory.mktemp("usererr")
    d = load_digits()
    x, y = d.data[:600].astype(np.float32), d.target[:600].astype(np.int64)
    for name, labels in (("train", y), ("shifted", y + 1), ("halves", (y * 0.5).astype(np.float32))):
        np.savez(base / f"{name}.npz", x=x, y=labels)
        pack([str(base / f"{name}.npz")], str(base / f"{name}.h5"), quiet=True)
    return base


def write_config(path: Path, data: Path, run_dir: Path, extra: str = "", train: str = "train") -> Path:
    path.write_text(f"""
model: {{factory: "hpctrain.train.models:mlp", kwargs: {{hidden: [32], input_scale: 0.0625, num_classes: 10}}}}
data: {{train: ["{data / (train + '.h5')}"]}}
optimizer: {{name: adam, lr: 0.003}}
batch_size: 16
steps: 10
run_dir: "{run_dir}"
quiet: true
threads: 1
{extra}
""")
    return path


def run(argv, timeout=120, env=None):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=mpi_env(env), cwd=str(ROOT))


def one_error(r, needle: str) -> None:
    """Exit code 2, the message and a HINT, no traceback, nothing trained."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert needle in r.stderr and "\nHINT: " in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]


CASES = {
    "labels_out_of_range": (dict(train="shifted"), [],
                            "range from 1 to 10 but the model has 10 outputs (classes 0..9): label 10 at row"),
    "fractional_labels": (dict(train="halves"), [], "that are not class indices, e.g. 0.5 at row 1 of"),
    "unknown_kwarg": ({}, ["--set", "model.kwargs.hiden=[8]"],
                      "'hiden' not accepted by model.factory 'hpctrain.train.models:mlp'; it takes (in_features=64"),
    "bad_kwarg_value": ({}, ["--set", "model.kwargs.hidden=8"], "rejected model.kwargs {'hidden': 8"),
    "feature_width": ({}, ["--set", "model.kwargs.in_features=32"],
                      "shape (64,) = 64 features) do not fit the model of 'hpctrain.train.models:mlp': its first "
                      "layer '2' expects in_features=32"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_user_error_is_one_line_with_hint(data, tmp_path, case, dry_run):
    kw, args, needle = CASES[case]
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run", **kw)
    argv = ["train", str(cfg), *args]
    r = clirun.hpctrain([*argv, "--dry-run"]) if dry_run else run([*HPCTRAIN, *argv])
    one_error(r, needle)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_labels_checked_across_ranks(data, tmp_path):
    """Each rank reads half of the labels; the bad label lies in rank 1's half only: every
    rank stops with the same error (rank 0 prints it), nobody waits for the watchdog."""
    import h5py

    bad = tmp_path / "late.h5"
    with h5py.File(data / "train.h5") as src, h5py.File(bad, "w") as dst:
        dst["x"] = src["x"][:]
        y = src["y"][:]
        y[-1] = 12
        dst["y"] = y
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run")
    t0 = time.monotonic()
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--set", f'data.train=["{bad}"]'], timeout=120)
    assert r.returncode == 2, r.stdout[-3000:]
    assert r.stdout.count(f"label 12 at row 599 of {bad}") == 1 and "Traceback" not in r.stdout, r.stdout[-3000:]
    assert time.monotonic() - t0 < 60


def test_resume_of_another_models_checkpoint_lists_keys(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run", "checkpoint: {interval_steps: 5}")
    first = run([*HPCTRAIN, "train", str(cfg)])
    assert first.returncode == 0, first.stderr[-3000:]
    r = run([*HPCTRAIN, "train", str(cfg), "--resume", "auto", "--set", "model.kwargs.hidden=[16,16]",
             "--set", "steps=20"])
    one_error(r, "does not fit this model (it was written by model.factory 'hpctrain.train.models:mlp' with "
                 "kwargs {'hidden': [32]")
    assert "missing 2: 6.weight, 6.bias" in r.stderr
    assert "shape differs for 4 (checkpoint vs model): 2.weight (32, 64) vs (16, 64)" in r.stderr


def test_srun_world_size_mismatch_is_one_line(data, tmp_path):
    """A plain `srun` of an MPI build without srun support: one error per process, no traceback."""
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run")
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}
    for extra in ([], ["--dry-run"]):
        r = run([*HPCTRAIN, "train", str(cfg), *extra], env=env)
        one_error(r, "MPI world size is 1 but SLURM started 2 tasks")


def test_dry_run_rejects_configs_that_would_fail(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run")
    r = clirun.hpctrain(["train", str(cfg), "--dry-run", "--set", "model.factory=hpctrain.train.models:mpl"])
    one_error(r, "'hpctrain.train.models' has no callable 'mpl'\nHINT: did you mean 'mlp'?")
    r = clirun.hpctrain(["train", str(cfg), "--dry-run", "--set", f"model.factory={tmp_path / 'absent.py'}:net"])
    assert r.returncode == 2 and "absent.py' does not exist" in r.stderr, r.stderr
    # tensorboard: true without the package (a stand-in that fails to import, installed or not)
    shadow = tmp_path / "shadow" / "tensorboard"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('tensorboard is not installed (test stand-in)')\n")
    env = {"PYTHONPATH": str(shadow.parent) + os.pathsep + str(ROOT)}
    r = run([*HPCTRAIN, "train", str(cfg), "--dry-run", "--set", "tensorboard=true"], env=env)
    one_error(r, "tensorboard: true needs the tensorboard package")
    ok = run([*HPCTRAIN, "train", str(cfg), "--dry-run"], env=env)
    assert ok.returncode == 0 and "valid" in ok.stdout, ok.stderr


def test_sigterm_to_launcher_stops_like_sigterm_to_a_rank(data, tmp_path):
    """SIGTERM to `hpctrain launch`: every rank stops at one step, the checkpoint is written,
    rank 0 says where it stopped, and the launch exits 143; --resume auto then finishes."""
    from hpctrain.train import checkpoint as ckpt

    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run",
                       "debug: {slow_rank: 0, slow_ms: 30}\ncheckpoint: {interval_steps: 1000}")
    cmd = [*HPCTRAIN, "launch", "-n", "2", "--", *HPCTRAIN, "train", str(cfg), "--set", "steps=2000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpi_env(),
                            cwd=str(ROOT), start_new_session=True)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 150
        while not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the launcher only, not its process group
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    found = ckpt.newest_valid(tmp_path / "run" / "checkpoints")
    assert found is not None
    stopped_at = found[1]["step"]
    assert f"status: preempted at step {stopped_at}" in out, out[-3000:]
    assert f"written at step {stopped_at}; rerun with --resume auto to continue" in out, out[-3000:]
    again = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--resume", "auto", "--set", f"steps={stopped_at + 3}",
                        "--set", "debug.slow_ms=0"], timeout=180)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"at step {stopped_at + 3}" in again.stdout
