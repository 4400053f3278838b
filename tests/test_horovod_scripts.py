"""Ordinary Horovod-style PyTorch scripts (``import hpctrain.torch as hvd``) run under mpiexec."""
from pathlib import Path

import pytest

from mpirun import python_argv, run_mpi

pytestmark = pytest.mark.mpi

SCRIPTS = Path(__file__).parent / "horovod_scripts"

CASES = [
    ("train_mnist_style.py", 2, ["--fp16-allreduce", "--batches-per-allreduce", "2", "--gradient-predivide-factor", "2"]),
    ("api_tour.py", 3, []),
    ("strategies_and_helpers.py", 2, ["allreduce,parameter_server:1,model_average:3"]),
    ("process_sets_at_init.py", 2, []),
    ("process_sets_at_init.py", 3, []),
    ("timeline_from_env.py", 2, []),
]


@pytest.mark.parametrize("script,ranks,extra", CASES, ids=[f"{c[0][:-3]}-np{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_horovod_script(script, ranks, extra):
    # Without hpctrain's Open MPI default in the environment: scripts that start MPI before
    # importing hpctrain (from mpi4py import MPI first) must not print osc/ucx's error either.
    result = run_mpi(ranks, python_argv(str(SCRIPTS / script), *extra), timeout=300, env={"OMPI_MCA_osc": None})
    assert result.returncode == 0, result.stdout[-6000:]
    assert result.stdout.count("HOROVOD-SCRIPT-OK") == ranks, result.stdout[-6000:]
    assert "OSC UCX" not in result.stdout, result.stdout[-3000:]


def test_adasum_script_trains():
    result = run_mpi(2, python_argv(str(SCRIPTS / "train_mnist_style.py"), "--use-adasum", "--epochs", "1"), timeout=300)
    assert result.returncode == 0, result.stdout[-6000:]
    assert result.stdout.count("HOROVOD-SCRIPT-OK") == 2, result.stdout[-6000:]


def test_adasum_script_fails_clearly_without_hanging_at_three_ranks():
    result = run_mpi(3, python_argv(str(SCRIPTS / "train_mnist_style.py"), "--use-adasum", "--epochs", "1"), timeout=300)
    assert result.returncode != 0 and result.returncode != -9, result.stdout[-4000:]
    assert "Adasum" in result.stdout and "NotImplementedError" in result.stdout
