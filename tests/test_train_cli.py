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

import clirun
from mpirun import ROOT, mpi_env, python_argv, run_mpi

pytestmark = pytest.mark.mpi

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
    r = clirun.hpctrain(["train", str(cfg), "--dry-run", "--ranks", "3", "--set", "optimizer.lr=0.01",
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
    r = clirun.hpctrain(["train", str(cfg), "--dry-run"])
    assert r.returncode == 2
    assert "unknown key 'optimiser'" in r.stderr and "optimizer" in r.stderr and "batch_size" in r.stderr


def test_bad_override_value(data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run")
    r = clirun.hpctrain(["train", str(cfg), "--dry-run", "--set", "optimizer.name=lion"])
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
    dry = clirun.hpctrain(["train", str(cfg), "--dry-run", "--ranks", "2", *ok])
    assert dry.returncode == 0, dry.stderr
    assert "(24/batch)" in dry.stdout and "(8/batch)" in dry.stdout, dry.stdout
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg), *ok], timeout=180)
    assert r.returncode == 0 and "status: completed at step 4" in r.stdout, r.stdout[-3000:]
    for bad, want in ((["--set", "data.weights=[3,1,1]"], "data.weights: 3 numbers for 2 ranks"),
                      ([], "data.policy: weighted needs data.weights")):
        argv = ["--set", "data.policy=weighted", *bad, "--set", f"run_dir={tmp_path / 'bad'}"]
        dry = clirun.hpctrain(["train", str(cfg), "--dry-run", "--ranks", "2", *argv])
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
    r = clirun.hpctrain(["train", str(cfg), "--dry-run", "--ranks", "4"])
    assert r.returncode == 0, r.stderr
    assert "pipeline: 4 ranks = 2 data-parallel replica(s) x 2 stages" in r.stdout and "ranks: 2" in r.stdout
    assert "global batch 32" in r.stdout
    for ranks, needle in (("3", "world size 3 is not divisible by the 2 pipeline stages"),
                          ("1", "2 pipeline stages need at least 2 ranks")):
        r = clirun.hpctrain(["train", str(cfg), "--dry-run", "--ranks", ranks])
        assert r.returncode == 2 and needle in r.stderr and "HINT" in r.stderr, r.stderr
    r = clirun.hpctrain(["train", str(cfg), "--dry-run", "--ranks", "2", "--set", "parallel.split_points=[9]"])
    assert r.returncode == 2 and "split points [9] out of range" in r.stderr, r.stderr
    r = clirun.hpctrain(["train", str(cfg), "--dry-run", "--ranks", "2", "--set", "parallel.micro_batches=32"])
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


# ---------------------------------------------------------------------------- checkpoint files
class Payload:
    """Unpickling this runs ``touch marker``: the proof that a reader unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


REFUSED = "not a valid hpctrain checkpoint: it holds a pickled Python object (posix.system), " \
          "not only tensors and plain types, and hpctrain never unpickles those"


def _files(directory: Path):
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def _one_line_error(out: str, path: Path) -> None:
    """The refusal of ``path``: one line naming it, printed once, no traceback."""
    assert "Traceback" not in out, out[-4000:]
    lines = [ln for ln in out.splitlines() if "not a valid hpctrain checkpoint" in ln]
    assert lines == [f"hpctrain train: {path}: {REFUSED}"], out[-4000:]


def test_resume_auto_past_a_payload_and_a_truncated_file_with_keep_1(data, tmp_path):
    """A planted payload and a truncated file, both named as newer than any real step: --resume
    auto runs neither, resumes from the newest valid checkpoint, keeps the new save, and moves
    both files aside (never deletes them); --resume of the payload itself is a one-line error."""
    import torch

    marker = tmp_path / "payload-ran"
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run", "checkpoint: {interval_steps: 4, keep: 5}")
    first = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--set", "steps=8"], timeout=180)
    assert first.returncode == 0, first.stdout[-3000:]
    d = tmp_path / "run" / "checkpoints"
    good = (d / "ckpt-000000008.pt").read_bytes()
    (d / "ckpt-000009999.pt").write_bytes(good[: len(good) // 2])
    torch.save({"format": 1, "step": 9998, "model": Payload(marker)}, d / "ckpt-000009998.pt")
    again = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--resume", "auto", "--set", "steps=12",
                        "--set", "checkpoint.keep=1"], timeout=180)
    out = again.stdout
    assert again.returncode == 0, out[-4000:]
    assert f"resumed from {d / 'ckpt-000000008.pt'} (step 8" in out, out[-4000:]
    assert (f"skipping checkpoint that does not load: {d / 'ckpt-000009999.pt'}: not a valid hpctrain checkpoint: "
            "cannot be loaded, truncated or corrupt") in out, out[-4000:]
    assert f"skipping checkpoint that does not load: {d / 'ckpt-000009998.pt'}: {REFUSED}" in out, out[-4000:]
    assert "status: completed at step 12" in out
    assert _files(d) == ["ckpt-000000012.pt", "quarantine"]
    assert _files(d / "quarantine") == ["ckpt-000009998.pt", "ckpt-000009999.pt"]
    assert (d / "quarantine" / "ckpt-000009999.pt").read_bytes() == good[: len(good) // 2]
    for name in ("ckpt-000009998.pt", "ckpt-000009999.pt"):
        assert f"moved {d / name} to {d / 'quarantine' / name}" in out, out[-4000:]
    bad = d / "quarantine" / "ckpt-000009998.pt"
    refused = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--resume", str(bad), "--set", "steps=14"], timeout=180)
    assert refused.returncode == 2, refused.stdout[-4000:]
    _one_line_error(refused.stdout, bad)
    assert not marker.exists()


def test_resume_from_an_older_checkpoint_keeps_its_new_saves(data, tmp_path):
    """--resume of step 4 into a directory holding steps 8 and 12, keep=1: the first new save
    (step 6) must survive its own pruning; the abandoned 8 and 12 are moved aside."""
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run", "checkpoint: {interval_steps: 4, keep: 5}")
    first = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--set", "steps=12"], timeout=180)
    assert first.returncode == 0, first.stdout[-3000:]
    d = tmp_path / "run" / "checkpoints"
    again = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--resume", str(d / "ckpt-000000004.pt"), "--set", "steps=11",
                        "--set", "checkpoint.interval_steps=3", "--set", "checkpoint.keep=1"], timeout=180)
    assert again.returncode == 0, again.stdout[-4000:]
    assert "status: completed at step 11" in again.stdout
    assert _files(d) == ["ckpt-000000011.pt", "superseded"]
    assert _files(d / "superseded") == ["ckpt-000000008.pt", "ckpt-000000012.pt"]


def test_pipeline_payloads_never_run_through_merge_or_resume(data, tmp_path):
    """A payload in a stage file and one in meta.pt: the merge tool refuses the stage file in
    one line; --resume auto skips both checkpoints (to the newest that loads) and moves them
    aside; --resume of the payload's directory is a one-line error. Nothing runs."""
    import torch

    marker = tmp_path / "payload-ran"
    cfg = write_config(tmp_path / "c.yaml", data, tmp_path / "run",
                       PIPELINE + "\ncheckpoint: {interval_steps: 2, keep: 5}")
    first = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--set", "steps=6"], timeout=180)
    assert first.returncode == 0, first.stdout[-3000:]
    d = tmp_path / "run" / "checkpoints"
    stage1 = d / "pipeline-000000006" / "stage-001-of-002.pt"
    torch.save({**torch.load(stage1, weights_only=True), "optimizer": Payload(marker)}, stage1)
    meta4 = d / "pipeline-000000004" / "meta.pt"
    torch.save({**torch.load(meta4, weights_only=True), "extra": Payload(marker)}, meta4)

    m = run(python_argv("-m", "hpctrain.parallel.checkpoint", "merge", str(stage1.parent), "-o",
                        str(tmp_path / "model.pt")))
    assert m.returncode == 2 and "Traceback" not in m.stderr, m.stderr
    assert m.stderr.strip().splitlines()[-1] == f"error: {stage1}: {REFUSED}", m.stderr
    assert not (tmp_path / "model.pt").exists()

    again = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--resume", "auto", "--set", "steps=8",
                        "--set", "checkpoint.keep=1"], timeout=180)
    out = again.stdout
    assert again.returncode == 0, out[-4000:]
    assert f"resumed from {d / 'pipeline-000000002'} (step 2" in out, out[-4000:]
    assert f"skipping pipeline checkpoint that does not load: {stage1}: {REFUSED}" in out, out[-4000:]
    assert _files(d) == ["pipeline-000000008", "quarantine"]
    assert _files(d / "quarantine") == ["pipeline-000000004", "pipeline-000000006"]

    bad = d / "quarantine" / "pipeline-000000006"
    refused = run_mpi(2, [*HPCTRAIN, "train", str(cfg), "--resume", str(bad), "--set", "steps=10"], timeout=180)
    assert refused.returncode == 2, refused.stdout[-4000:]
    _one_line_error(refused.stdout, bad / "stage-001-of-002.pt")
    assert not marker.exists()
