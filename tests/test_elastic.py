"""Elastic training inside one MPI job: ranks SIGKILLed at a random step, the survivors
re-form the world and finish (``hpctrain launch --elastic``: Open MPI's ``--with-ft ulfm``).

Each run is compared with a reference run that starts on the survivors' number of ranks
from the state they resumed from (written by the training script's reset callback): the
recovery is exact when the final weights are equal, bit for bit."""
import random
import sys
from pathlib import Path

import pytest
import torch

from mpirun import ROOT, python_argv, run_command, run_mpi

# Not in the "mpi-launches" xdist group: these launches are short, their ranks yield while they
# wait (mpirun.mpi_env), and the group's worker is the suite's longest already.
pytestmark = pytest.mark.mpi

SCRIPT = str(ROOT / "tests" / "elastic" / "elastic_train.py")
STEPS = 15


def _ft_available() -> bool:
    from mpi4py import MPI

    return hasattr(MPI.Comm, "Shrink")


def launch_elastic(out: Path, ranks: int, kill: str, where: str, min_np=None, timeout: float = 300, replay=True,
                   env=None):
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hpctrain.cli.main", "launch", "--elastic", "-n", str(ranks)]
    if min_np is not None:
        cmd += ["--min-np", str(min_np)]
    cmd += ["--", *python_argv(SCRIPT, "--steps", str(STEPS), "--kill", kill, "--where", where, "--out", str(out),
                               *(["--replay"] if replay else []))]
    return run_command(cmd, timeout=timeout, env=env)


def finals(out: Path) -> dict:
    return {int(p.stem.split("-")[1]): torch.load(p, weights_only=True) for p in out.glob("final-*.pt")}


def reference_weights(tmp: Path, resumed: Path, ranks: int) -> torch.Tensor:
    """A plain (not elastic) run on ``ranks`` ranks from the state the survivors resumed from."""
    ref = tmp / "reference"
    ref.mkdir()
    result = run_mpi(ranks, python_argv(SCRIPT, "--steps", str(STEPS), "--resume", str(resumed), "--out", str(ref)),
                     timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    weights = {r: f["weights"] for r, f in finals(ref).items()}
    assert len(weights) == ranks
    return weights[0]


def check_exact_recovery(tmp: Path, out: Path, result, survivors: int, lost: list, resets: int,
                         fresh_reference: bool = False) -> None:
    """Every survivor finished with the same weights, the launch named the lost ranks, and the
    weights equal the reference's: a run from the state resumed at the last reset, on the
    survivors — replayed by the survivors themselves (``--replay``) or, with
    ``fresh_reference``, a new plain launch started from that state."""
    text = result.stdout
    assert result.returncode == 0, text[-6000:]
    done = finals(out)
    assert sorted(done) == sorted(set(range(survivors + len(lost))) - set(lost)), (sorted(done), text[-3000:])
    assert all(f["size"] == survivors and f["step"] == STEPS for f in done.values())
    first = next(iter(done.values()))["weights"]
    assert all(torch.equal(f["weights"], first) for f in done.values()), "survivors' weights differ"
    assert f"{len(lost)} of {survivors + len(lost)} rank(s) lost" in text, text[-3000:]
    for r in lost:
        assert f"lost launched rank(s) {r}" in text, text[-3000:]
    resumed = out / f"resumed-{resets}.pt"
    assert resumed.exists(), sorted(p.name for p in out.iterdir())
    if fresh_reference:
        assert torch.equal(reference_weights(tmp, resumed, survivors), first), "recovery is not exact"
    else:
        replays = {int(p.stem.split("-")[1]): torch.load(p, weights_only=True)["weights"] for p in out.glob("replay-*.pt")}
        assert sorted(replays) == sorted(done), sorted(p.name for p in out.iterdir())
        assert all(torch.equal(w, first) for w in replays.values()), "recovery is not exact"


WHERE = ["optimizer", "allreduce", "grouped", "shm"]


@pytest.mark.parametrize("where", WHERE)
def test_a_rank_killed_at_a_random_step_and_the_survivors_finish_exactly(tmp_path, where):
    if not _ft_available():
        pytest.skip("mpi4py without the ULFM extension")
    rng = random.Random()
    victim, step = rng.randrange(3), rng.randrange(1, STEPS - 2)
    fresh = where == "optimizer"  # one case against a new launch, the others against the survivors' replay
    result = launch_elastic(tmp_path / "run", 3, f"{victim}:{step}", where, replay=not fresh)
    print(f"killed launched rank {victim} at step {step} ({where})")
    check_exact_recovery(tmp_path, tmp_path / "run", result, 2, [victim], 1, fresh_reference=fresh)


def test_a_rank_lost_while_small_all_reduces_ride_on_the_check_through_rank_0(tmp_path):
    """Without the shared-memory flags (as across nodes) small all-reduces carry their data on
    the agreement check through rank 0, in C: a lost rank (rank 0 itself, or another) still
    becomes a reset the survivors recover from exactly."""
    if not _ft_available():
        pytest.skip("mpi4py without the ULFM extension")
    rng = random.Random()
    victim, step = rng.choice([0, 2]), rng.randrange(1, STEPS - 2)
    result = launch_elastic(tmp_path / "run", 3, f"{victim}:{step}", "allreduce",
                            env={"HPCTRAIN_SHM_FLAGS": "0"})
    print(f"killed launched rank {victim} at step {step}")
    check_exact_recovery(tmp_path, tmp_path / "run", result, 2, [victim], 1)


def test_two_ranks_lost_one_after_the_other(tmp_path):
    if not _ft_available():
        pytest.skip("mpi4py without the ULFM extension")
    result = launch_elastic(tmp_path / "run", 4, "3:4,1:9", "optimizer")
    check_exact_recovery(tmp_path, tmp_path / "run", result, 2, [1, 3], 2)
    assert "4 -> 3 ranks" in result.stdout and "3 -> 2 ranks" in result.stdout


def test_a_stall_explained_by_a_lost_rank_reforms_instead_of_aborting(tmp_path):
    """Launched rank 0 waits for a message from rank 1 (busy 8 s outside MPI) when rank 2 dies:
    no MPI call of rank 0 involves the dead rank, so its stall watchdog (3 s) fires; MPI knows
    of a failed process, so the watchdog revokes instead of aborting and the survivors re-form."""
    if not _ft_available():
        pytest.skip("mpi4py without the ULFM extension")
    result = launch_elastic(tmp_path / "run", 3, "2:6", "stall", env={"HPCTRAIN_STALL_TIMEOUT": "3"})
    assert "a process of the job has failed: treating it as a lost rank" in result.stdout, result.stdout[-4000:]
    check_exact_recovery(tmp_path, tmp_path / "run", result, 2, [2], 1)


def test_rank_zero_killed_while_writing_a_checkpoint_loses_no_checkpoint(tmp_path):
    if not _ft_available():
        pytest.skip("mpi4py without the ULFM extension")
    result = launch_elastic(tmp_path / "run", 3, "0:6", "checkpoint")
    check_exact_recovery(tmp_path, tmp_path / "run", result, 2, [0], 1)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert saved["step"] == STEPS // 3 * 3  # the new rank 0 wrote the later ones


def test_below_min_ranks_every_survivor_stops_with_the_reason(tmp_path):
    if not _ft_available():
        pytest.skip("mpi4py without the ULFM extension")
    result = launch_elastic(tmp_path / "run", 3, "2:5", "optimizer", min_np=3, timeout=240)
    assert result.returncode not in (0, -9), result.stdout[-4000:]
    assert "fewer than min_ranks=3" in result.stdout, result.stdout[-4000:]
    assert not list((tmp_path / "run").glob("final-*.pt"))


def test_without_fault_tolerance_elastic_mode_refuses_to_start(tmp_path):
    result = run_mpi(2, python_argv(SCRIPT, "--steps", "2", "--out", str(tmp_path)), env={"HPCTRAIN_ELASTIC": "1"},
                     timeout=120)
    assert result.returncode != 0
    assert "cannot survive a lost rank" in result.stdout and "--with-ft ulfm" in result.stdout, result.stdout[-3000:]


def test_the_training_runner_loses_a_rank_and_completes(tmp_path):
    """`hpctrain train` with elastic.min_ranks on 3 ranks; launched rank 1 is SIGKILLed in
    step 13: the two survivors resume from the step-12 checkpoint with the data planned over
    them, finish all 30 steps, and metrics.jsonl, summary.json and the report name the loss."""
    if not _ft_available():
        pytest.skip("mpi4py without the ULFM extension")
    import json

    import numpy as np

    from hpctrain.data.pack import pack

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "train.npz", x=rng.normal(size=(600, 8)).astype(np.float32),
             y=rng.integers(0, 3, 600).astype(np.int64))
    pack([str(tmp_path / "train.npz")], str(tmp_path / "train.h5"), quiet=True)
    cfg = tmp_path / "c.yaml"
    run_dir = tmp_path / "run"
    cfg.write_text(f"""
model: {{factory: "hpctrain.train.models:mlp", kwargs: {{hidden: [16]}}}}
data: {{train: ["{tmp_path / 'train.h5'}"]}}
batch_size: 8
steps: 30
run_dir: "{run_dir}"
quiet: true
threads: 1
checkpoint: {{interval_steps: 4}}
elastic: {{min_ranks: 2}}
debug: {{kill_at_step: 13, kill_rank: 1}}
""")
    cmd = [sys.executable, "-m", "hpctrain.cli.main", "launch", "--elastic", "-n", "3", "--",
           sys.executable, "-m", "hpctrain.cli.main", "train", str(cfg)]
    result = run_command(cmd, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out[-5000:]
    assert "lost launched rank(s) 1" in out, out[-3000:]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lost = [e for e in events if e.get("what") == "ranks_lost"]
    assert len(lost) == 1 and lost[0]["lost"] == [1] and lost[0]["step"] == 13, lost
    assert lost[0]["ranks"] == 2 and lost[0]["resumed_step"] == 12, lost
    train = [e for e in events if e.get("kind") == "train"]
    assert train[-1]["step"] == 30 and len(train[-1]["rank_step_time"]) == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["result"]["status"] == "completed" and summary["world_size"] == 2
    assert summary["ranks_lost"][0]["lost"] == [1]
    report = run_command([sys.executable, "-m", "hpctrain.cli.main", "report", str(run_dir)], timeout=120)
    assert "lost rank(s) 1 in step 13: 3 -> 2 ranks, resumed from step 12" in report.stdout, report.stdout[-3000:]
