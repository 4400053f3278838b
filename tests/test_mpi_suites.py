"""Run every ``tests/mpi/test_*.py`` under a real ``mpiexec`` at each of its ``RANKS``.

The files that run at the same rank count (and variant) share one launch: each rank starts
Python, torch and pytest once (~6 s of CPU) instead of once per file. Each file is still its
own test here, judged from what every rank recorded (``mpirun.file_verdicts``); a launch runs
only the files selected in this session (``-k``, ``-m``). Under pytest-xdist every launch runs
on one worker, one after another (one ``xdist_group``): two launches side by side on a 2-core
machine oversubscribe it, and ranks that wait for a peer spin (MPI's progress loop, the
shared-memory flags), which doubled the launches' CPU time.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Tuple

import pytest

from mpirun import CHILD_ENV, CHILD_PYTEST, RESULTS_ENV, ROOT, file_verdicts, python_argv, read_results, run_mpi

pytestmark = pytest.mark.mpi

MPI_DIR = Path(__file__).parent / "mpi"


def declared(path: Path, name: str, default):
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return default


SLOW_TIMEOUT = 400  # a file that budgets this long (TIMEOUT) is marked slow


def launches():
    """(ranks, variant) → [(file, extra environment)]: each file at each of its RANKS; and at each
    of its VARIANT_RANKS once per entry of its VARIANTS (name → extra environment), e.g. the
    fall-back paths without the C extension."""
    out: Dict[Tuple[int, str], list] = {}
    for path in sorted(MPI_DIR.glob("test_*.py")):
        for n in declared(path, "RANKS", (1, 2)):
            out.setdefault((n, ""), []).append((path, {}))
        for name, env in declared(path, "VARIANTS", {}).items():
            for n in declared(path, "VARIANT_RANKS", (2,)):
                out.setdefault((n, name), []).append((path, env))
    return out


LAUNCHES = launches()


def cases():
    for (n, variant), files in LAUNCHES.items():
        budget = sum(declared(path, "TIMEOUT", 240) for path, _ in files) + 120
        for path, env in files:
            marks = [pytest.mark.xdist_group("mpi-launches"), pytest.mark.timeout(budget)]
            if declared(path, "TIMEOUT", 240) >= SLOW_TIMEOUT:
                marks.append(pytest.mark.slow)
            name = f"{path.stem}-{variant}-np{n}" if variant else f"{path.stem}-np{n}"
            yield pytest.param(path, n, variant, env, id=name, marks=marks)


_RUN: Dict[Tuple[int, str], tuple] = {}  # (ranks, variant) → (the launch's result, each file's verdict)


def _selected_files(session, n: int, variant: str):
    """This launch's files that this session runs, in order (what -k / -m left of them)."""
    files = []
    for item in session.items:
        spec = getattr(item, "callspec", None)
        if item.originalname == "test_mpi_file" and spec and (spec.params["n"], spec.params["variant"]) == (n, variant):
            files.append((spec.params["path"], spec.params["env"]))
    return files


def _launch(n: int, variant: str, files, folder: Path):
    timeout = sum(declared(path, "TIMEOUT", 240) for path, _ in files)
    names = [str(path.relative_to(ROOT)) for path, _ in files]
    result = run_mpi(n, python_argv(*CHILD_PYTEST, "--color=no", *names), timeout=timeout,
                     env={**CHILD_ENV, **files[0][1], RESULTS_ENV: str(folder)})
    return result, file_verdicts(names, read_results(folder), n, result.returncode)


@pytest.mark.parametrize("path,n,variant,env", list(cases()))
def test_mpi_file(path: Path, n: int, variant: str, env: dict, request, tmp_path_factory):
    if (n, variant) not in _RUN:
        folder = tmp_path_factory.mktemp(f"mpi-np{n}-{variant or 'plain'}")
        _RUN[n, variant] = _launch(n, variant, _selected_files(request.session, n, variant), folder)
    result, verdicts = _RUN[n, variant]
    why = verdicts[str(path.relative_to(ROOT))]
    assert why is None, (f"{path.name} at {n} ranks {env or ''}: {why}\n"
                         f"(launch: {' '.join(result.args[-len(verdicts):])})\n{result.stdout[-8000:]}")
