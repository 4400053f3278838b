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

pytestmark = [pytest.mark.mpi, pytest.mark.xdist_group("mpi-launches")]

SCRIPT = str(ROOT / "tests" / "elastic" / "elastic_train.py")
STEPS = 15


def _ft_available() -> bool:
    from mpi4py import MPI

    return hasattr(MPI.Comm, "Shrink")


def launch_elastic(out: Path, ranks: int, kill: str, where: str, min_np=None, timeout: float = 300):
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hpctrain.cli.main", "launch", "--elastic", "-n", str(ranks)]
    if min_np is not None:
        cmd += ["--min-np", str(min_np)]
    cmd += ["--", *python_argv(SCRIPT, "--steps", str(STEPS), "--kill", kill, "--where", where, "--out", str(out))]
    return run_command(cmd, timeout=timeout)


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


def check_exact_recovery(tmp: Path, out: Path, result, survivors: int, lost: list, resets: int) -> None:
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
    assert torch.equal(reference_weights(tmp, resumed, survivors), first), "recovery is not exact"


WHERE = ["optimizer", "allreduce", "grouped", "shm", "sync"]


@pytest.mark.parametrize("where", WHERE)
def test_a_rank_killed_at_a_random_step_and_the_survivors_finish_exactly(tmp_path, where):
    if not _ft_available():
        pytest.skip("mpi4py without the ULFM extension")
    rng = random.Random()
    victim, step = rng.randrange(3), rng.randrange(1, STEPS - 2)
    if where == "sync":
        step = 3 * rng.randrange(1, STEPS // 3)  # right after a commit
    result = launch_elastic(tmp_path / "run", 3, f"{victim}:{step}", where)
    print(f"killed launched rank {victim} at step {step} ({where})")
    check_exact_recovery(tmp_path, tmp_path / "run", result, 2, [victim], 1)


def test_two_ranks_lost_one_after_the_other(tmp_path):
    if not _ft_available():
        pytest.skip("mpi4py without the ULFM extension")
    result = launch_elastic(tmp_path / "run", 4, "3:4,1:9", "optimizer")
    check_exact_recovery(tmp_path, tmp_path / "run", result, 2, [1, 3], 2)
    assert "4 -> 3 ranks" in result.stdout and "3 -> 2 ranks" in result.stdout


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
