"""`hpctrain train` driven from outside: fault injection under mpiexec -n 3, dry-run,
unwritable checkpoint directory, bad config, report."""
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from mpirun import ROOT, mpi_env, python_argv, run_mpi

HPCTRAIN = python_argv("-m", "hpctrain.cli.main")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from hpctrain.data.pack import pack
    from sklearn.datasets import load_digits

    base = tmp_path_factory.mktemp("traindata")
    d = load_digits()
    np.savez(base / "train.npz", x=d.data[:900].astype(np.float32), y=d.target[:900].astype(np.int64))
    np.savez(base / "test.npz", x=d.data[900:1200].astype(np.float32), y=d.target[900:1200].astype(np.int64))
    pack([str(base / "train.npz")], str(base / "train.h5"), quiet=True)
    pack([str(base / "test.npz")], str(base / "test.h5"), quiet=True)
    return base


def write_config(path: Path, data: Path, run_dir: Path, extra: str = "") -> Path:
    path.write_text(f"""
model: {{factory: "hpctrain.train.models:mlp", kwargs: {{hidden: [32], input_scale: 0.0625}}}}
data: {{train: ["{data / 'train.h5'}"], test: ["{data / 'test.h5'}"]}}
optimizer: {{name: adam, lr: 0.003}}
batch_size: 16
steps: 40
run_dir: "{run_dir}"
quiet: true
threads: 1
{extra}
""")
    return path


def run(argv, timeout=120, cwd=None, env=None):
    e = mpi_env(env)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=e, cwd=str(cwd or ROOT))


def test_exception_on_rank_1_at_step_5_aborts_within_30s(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run",
                       "debug: {fail_at_step: 5, fail_rank: 1}\ncheckpoint: {interval_steps: 2}")
    result = run_mpi(3, [*HPCTRAIN, "train", str(cfg)], timeout=180, env={"HPCTRAIN_STALL_TIMEOUT": "300"})
    end = time.time()
    out = result.stdout
    assert result.returncode not in (0, -9), out[-4000:]
    assert "rank 1 raised an unhandled exception" in out, out[-4000:]
    assert "debug.fail_at_step=5: injected failure on rank 1" in out, out[-4000:]
    m = re.search(r"at unix time (\d+\.\d+)", out)
    assert m, out[-4000:]
    elapsed = end - float(m.group(1))
    assert elapsed < 30, f"job took {elapsed:.1f}s to exit after the failure"
    # The checkpoints written before the failure are intact.
    from hpctrain.train import checkpoint as ckpt

    found = ckpt.newest_valid(tmp_path / "run" / "checkpoints")
    assert found is not None and found[1]["step"] == 4


def test_dry_run_prints_plan_and_trains_nothing(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run")
    r = run([*HPCTRAIN, "train", str(cfg), "--dry-run", "--ranks", "3", "--set", "optimizer.lr=0.01",
             "--set", "lr_scaling=linear"])
    assert r.returncode == 0, r.stderr
    assert "ranks: 3" in r.stdout
    assert "rank 0: 288 samples (16/batch), rank 1: 288 samples (16/batch), rank 2: 288 samples" in r.stdout
    assert "global batch 48" in r.stdout
    assert "learning rate: 0.03 (base 0.01, lr_scaling linear" in r.stdout
    assert "dry run: nothing trained" in r.stdout
    assert not (tmp_path / "run").exists()


def test_dry_run_under_mpiexec_uses_world_size(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run")
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--dry-run"], timeout=120)
    assert r.returncode == 0, r.stdout
    assert r.stdout.count("ranks: 2") == 1  # printed by rank 0 only


def test_unknown_key_lists_valid_ones(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run", "optimiser: {lr: 1}")
    r = run([*HPCTRAIN, "train", str(cfg), "--dry-run"])
    assert r.returncode == 2
    assert "unknown key 'optimiser'" in r.stderr and "optimizer" in r.stderr and "batch_size" in r.stderr


def test_bad_override_value(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run")
    r = run([*HPCTRAIN, "train", str(cfg), "--dry-run", "--set", "optimizer.name=lion"])
    assert r.returncode == 2 and "optimizer.name: 'lion' is not one of" in r.stderr


def test_unwritable_checkpoint_dir_fails_before_training(data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run", f'checkpoint: {{dir: "{blocker / "ckpt"}"}}')
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg)], timeout=120)
    assert r.returncode != 0
    assert "cannot be created" in r.stdout and "HINT" in r.stdout, r.stdout[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_weighted_policy_dry_run_and_run_agree(data, tmp_path):
    """data.policy: weighted takes its shares from data.weights; what the run rejects, --dry-run
    rejects too, with the same line."""
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run")
    ok = ["--set", "data.policy=weighted", "--set", "data.weights=[3,1]", "--set", "steps=4"]
    dry = run([*HPCTRAIN, "train", str(cfg), "--dry-run", "--ranks", "2", *ok])
    assert dry.returncode == 0, dry.stderr
    assert "(24/batch)" in dry.stdout and "(8/batch)" in dry.stdout, dry.stdout
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg), *ok], timeout=180)
    assert r.returncode == 0 and "status: completed at step 4" in r.stdout, r.stdout[-3000:]
    for bad, want in ((["--set", "data.weights=[3,1,1]"], "data.weights: 3 numbers for 2 ranks"),
                      ([], "data.policy: weighted needs data.weights")):
        argv = ["--set", "data.policy=weighted", *bad, "--set", f"run_dir={tmp_path / 'bad'}"]
        dry = run([*HPCTRAIN, "train", str(cfg), "--dry-run", "--ranks", "2", *argv])
        assert dry.returncode == 2 and want in dry.stderr, dry.stderr
        r = run_mpi(2, [*HPCTRAIN, "train", str(cfg), *argv], timeout=120)
        assert r.returncode == 2 and r.stdout.count(want) == 1, r.stdout[-3000:]
        assert "Traceback" not in r.stdout


def test_train_then_report(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run", "eval: {interval_steps: 10}")
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg)], timeout=180)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "test accuracy:" in r.stdout and "run directory:" in r.stdout
    rep = run([*HPCTRAIN, "report", str(tmp_path / "run")])
    assert rep.returncode == 0, rep.stderr
    for name in ("loss.png", "throughput.png", "compute_comm.png", "rank_step_time.png", "summary.txt"):
        assert (tmp_path / "run" / "report" / name).stat().st_size > 0
    assert "2 rank(s)" in rep.stdout and "test accuracy" in rep.stdout
    # --resume auto on a finished run: nothing left to do, exits 0 at the same step.
    again = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--resume", "auto"], timeout=180)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "at step 40" in again.stdout


def test_preemption_signal_on_one_rank_checkpoints_and_resume_finishes(data, tmp_path):
    """SIGUSR1 to rank 1 only: every rank stops at the same step, a checkpoint is written, the
    job exits 128+10 (no SLURM to requeue); `--resume auto` then finishes the run."""
    import psutil

    from mpirun import mpiexec_argv
    from hpctrain.train import checkpoint as ckpt

    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run",
                       "debug: {slow_rank: 0, slow_ms: 30}\ncheckpoint: {interval_steps: 1000}")
    cmd = mpiexec_argv(2) + [*HPCTRAIN, "train", str(cfg), "--set", "steps=2000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpi_env(),
                            cwd=str(ROOT), start_new_session=True)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 150
        while not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "hpctrain.cli.main" in " ".join(p.cmdline())]
        assert len(ranks) == 2, ranks
        by_rank = {int(p.environ().get("OMPI_COMM_WORLD_RANK", "-1")): p for p in ranks}
        by_rank[1].send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGUSR1, out[-3000:]
    assert "stop signal received" in out, out[-3000:]
    found = ckpt.newest_valid(tmp_path / "run" / "checkpoints")
    assert found is not None
    stopped_at = found[1]["step"]
    assert 3 <= stopped_at < 2000
    again = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--resume", "auto", "--set", "steps=" + str(stopped_at + 5),
                        "--set", "debug.slow_ms=0"], timeout=180)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"at step {stopped_at + 5}" in again.stdout


PIPELINE = "parallel: {pipeline_stages: 2, micro_batches: 4, schedule: 1f1b}"


def test_pipeline_dry_run_counts_replicas_and_rejects_bad_input(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run", PIPELINE)
    r = run([*HPCTRAIN, "train", str(cfg), "--dry-run", "--ranks", "4"])
    assert r.returncode == 0, r.stderr
    assert "pipeline: 4 ranks = 2 data-parallel replica(s) x 2 stages" in r.stdout and "ranks: 2" in r.stdout
    assert "global batch 32" in r.stdout
    for ranks, needle in (("3", "world size 3 is not divisible by the 2 pipeline stages"),
                          ("1", "2 pipeline stages need at least 2 ranks")):
        r = run([*HPCTRAIN, "train", str(cfg), "--dry-run", "--ranks", ranks])
        assert r.returncode == 2 and needle in r.stderr and "HINT" in r.stderr, r.stderr
    r = run([*HPCTRAIN, "train", str(cfg), "--dry-run", "--ranks", "2", "--set", "parallel.split_points=[9]"])
    assert r.returncode == 2 and "split points [9] out of range" in r.stderr, r.stderr
    r = run([*HPCTRAIN, "train", str(cfg), "--dry-run", "--ranks", "2", "--set", "parallel.micro_batches=32"])
    assert r.returncode == 2 and "cannot be cut into parallel.micro_batches=32" in r.stderr, r.stderr


def test_pipeline_more_stages_than_ranks_fails_before_training(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run",
                       "parallel: {pipeline_stages: 3, micro_batches: 4}")
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg)], timeout=120)
    assert r.returncode == 2, r.stdout[-3000:]
    assert r.stdout.count("3 pipeline stages need at least 3 ranks (one per stage), but the job has 2") == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_pipeline_train_and_merge_from_the_shell(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run", PIPELINE)
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--set", "steps=10"], timeout=180)
    assert r.returncode == 0, r.stdout[-3000:]
    ckpt_dir = tmp_path / "run" / "checkpoints" / "pipeline-000000010"
    assert f"checkpoint: {ckpt_dir}" in r.stdout and "status: completed at step 10" in r.stdout
    out = tmp_path / "model.pt"
    m = run(python_argv("-m", "hpctrain.parallel.checkpoint", "merge", str(ckpt_dir), "-o", str(out)))
    assert m.returncode == 0, m.stderr
    import torch

    from hpctrain.train.models import mlp

    mlp(hidden=[32], input_scale=0.0625).load_state_dict(torch.load(out))
