"""Run every ``tests/mpi/test_*.py`` under a real ``mpiexec`` at each of its ``RANKS``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mpirun import CHILD_ENV, CHILD_PYTEST, ROOT, python_argv, run_mpi

pytestmark = pytest.mark.mpi

MPI_DIR = Path(__file__).parent / "mpi"


def declared(path: Path, name: str, default):
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return default


SLOW_TIMEOUT = 400  # a file that budgets this long (TIMEOUT) is marked slow


def cases():
    """Each file at each of its RANKS; and at each of its VARIANT_RANKS once per entry of its
    VARIANTS (name → extra environment), e.g. the fall-back paths without the C extension."""
    for path in sorted(MPI_DIR.glob("test_*.py")):
        marks = [pytest.mark.slow] if declared(path, "TIMEOUT", 240) >= SLOW_TIMEOUT else []
        for n in declared(path, "RANKS", (1, 2)):
            yield pytest.param(path, n, {}, id=f"{path.stem}-np{n}", marks=marks)
        for name, env in declared(path, "VARIANTS", {}).items():
            for n in declared(path, "VARIANT_RANKS", (2,)):
                yield pytest.param(path, n, env, id=f"{path.stem}-{name}-np{n}", marks=marks)


@pytest.mark.parametrize("path,n,env", list(cases()))
def test_mpi_file(path: Path, n: int, env: dict):
    timeout = declared(path, "TIMEOUT", 240)
    result = run_mpi(
        n,
        python_argv(*CHILD_PYTEST, str(path.relative_to(ROOT))),
        timeout=timeout,
        env={**CHILD_ENV, **env},
    )
    assert result.returncode == 0, (f"{path.name} at {n} ranks {env or ''} failed (rc={result.returncode}):\n"
                                    f"{result.stdout[-8000:]}")
