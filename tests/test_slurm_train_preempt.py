"""A *training job* (`hpctrain train` in the cpu-mpi template) preempted on the real local
SLURM: `scancel -b --signal=USR1` → every rank stops at the same step → checkpoint →
`scontrol requeue` → the rerun (SLURM_RESTART_COUNT=1) resumes → final weights bit-identical
to an uninterrupted run."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.slurm.submit import wait_for_job
from hpctrain.train.checkpoint import newest_valid
from slurm_fixture import ROOT, slurm_cluster  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

pytestmark = pytest.mark.usefixtures("slurm_cluster")
PY = sys.executable
HPCTRAIN = str(Path(PY).parent / "hpctrain")


def make_config(d: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 16)).astype(np.float32)
    y = (x @ rng.standard_normal((16, 4))).argmax(1).astype(np.int64)
    np.savez(d / "train.npz", x=x, y=y)
    subprocess.run([HPCTRAIN, "data", "pack", str(d / "train.npz"), "-o", str(d / "train.h5"), "-q"],
                   check=True, capture_output=True, timeout=120)
    config = d / "preempt.yaml"
    config.write_text(
        "model: {factory: 'hpctrain.train.models:mlp', kwargs: {in_features: 16, hidden: [32], num_classes: 4}}\n"
        f"data: {{train: [{d / 'train.h5'}], keys: {{x: x, y: y}}}}\n"
        "optimizer: {name: sgd, lr: 0.05, momentum: 0.9}\n"
        "batch_size: 16\nsteps: 50\nseed: 3\nquiet: true\nlog_interval: 1\n"
        "eval: {metrics: [loss]}\ncheckpoint: {interval_steps: 0, keep: 2}\n"
        "debug: {slow_rank: 0, slow_ms: 150}\n"   # ~0.15 s a step: time to preempt mid-run
    )
    return config


def submit(run_dir: Path, config: Path, name: str) -> int:
    argv = [PY, "-m", "hpctrain.cli.main", "slurm", "submit", "cpu-mpi", "--job-dir", str(run_dir),
            "--venv", sys.prefix, "--time", "5", "--signal-seconds", "30", "--nodes", "1",
            "--tasks-per-node", "2", "--job-name", name, "--",
            HPCTRAIN, "train", str(config), "--set", f"run_dir={run_dir / 'run'}", "--resume", "auto"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def steps_logged(run_dir: Path) -> int:
    p = run_dir / "run" / "metrics.jsonl"
    return sum(1 for line in p.read_text().splitlines() if '"step"' in line) if p.exists() else 0


def logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted(run_dir.glob("slurm-*")))


def final_weights(run_dir: Path):
    found = newest_valid(run_dir / "run" / "checkpoints")
    assert found, f"no checkpoint in {run_dir}"
    path, ckpt = found
    return path, ckpt


def test_training_job_preempted_requeued_resumes_identically(tmp_path):
    config = make_config(tmp_path)
    ref_dir, pre_dir = tmp_path / "reference", tmp_path / "preempted"
    ref = submit(ref_dir, config, "train-ref")
    pre = submit(pre_dir, config, "train-pre")
    deadline = time.monotonic() + 180
    while steps_logged(pre_dir) < 5:
        assert time.monotonic() < deadline, f"job {pre} made no progress:\n{logs(pre_dir)}"
        time.sleep(0.2)
    subprocess.run(["scancel", "-b", "--signal=USR1", str(pre)], check=True, timeout=30)
    info_ref, info_pre = wait_for_job(ref, timeout=300), wait_for_job(pre, timeout=300)
    assert info_ref["JobState"] == "COMPLETED", logs(ref_dir)
    assert info_pre["JobState"] == "COMPLETED", logs(pre_dir)
    assert info_pre["Restarts"] == "1", f"not requeued:\n{logs(pre_dir)}"
    _, a = final_weights(ref_dir)
    _, b = final_weights(pre_dir)
    assert (a["step"], a["epoch"]) == (b["step"], b["epoch"]) and a["step"] >= 50
    assert "resum" in logs(pre_dir).lower(), logs(pre_dir)
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), f"{key} differs after preempt/requeue/resume"
