"""Run every ``tests/mpi/test_*.py`` under a real ``mpiexec`` at each of its ``RANKS``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mpirun import ROOT, python_argv, run_mpi

MPI_DIR = Path(__file__).parent / "mpi"


def declared(path: Path, name: str, default):
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return default


def cases():
    for path in sorted(MPI_DIR.glob("test_*.py")):
        for n in declared(path, "RANKS", (1, 2)):
            yield pytest.param(path, n, id=f"{path.stem}-np{n}")


@pytest.mark.parametrize("path,n", list(cases()))
def test_mpi_file(path: Path, n: int):
    timeout = declared(path, "TIMEOUT", 240)
    result = run_mpi(
        n,
        python_argv("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(path.relative_to(ROOT))),
        timeout=timeout,
        env={"HPCTRAIN_MPI_CHILD": "1", "HPCTRAIN_STALL_TIMEOUT": "60"},
    )
    assert result.returncode == 0, f"{path.name} at {n} ranks failed (rc={result.returncode}):\n{result.stdout[-8000:]}"
