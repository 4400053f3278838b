"""Test layout.

- ``tests/unit/``: pure code, no MPI launcher needed.
- ``tests/mpi/``: pytest modules that run *under* ``mpiexec``; each declares
  ``RANKS = (…)``. They are collected only inside such a launch (``HPCTRAIN_MPI_CHILD=1``);
  ``tests/test_mpi_suites.py`` runs each file at each of its rank counts (the files of one
  rank count in one launch), with a timeout, so that a hang fails fast instead of stalling
  the suite.
- Other top-level tests drive the CLI, SLURM and the multi-node cluster.

Markers (``pytest.ini``) say what a test needs: each module outside ``tests/unit/`` sets
``pytestmark``; the fixtures below add ``slurm`` and ``cluster`` to the tests that use them,
so that ``pytest -m "not slurm"`` also leaves out a test that only asks for the scheduler.
"""
import os
from pathlib import Path

import pytest

try:
    from hypothesis import settings as _hypothesis_settings

    # CI (.ci/run sets HYPOTHESIS_PROFILE=ci): the same examples on every run, so that a red
    # build is the change's fault and reproduces; a developer's run explores new ones.
    _hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
except ImportError:  # the pure tests that use hypothesis skip themselves without it
    pass

if not os.environ.get("HPCTRAIN_MPI_CHILD"):
    collect_ignore_glob = ["mpi/*"]

HERE = Path(__file__).resolve().parent
KINDS = ("mpi", "slurm", "cluster", "gpu")
# fixture -> the markers a test that uses it gets
FIXTURE_KINDS = {
    "slurm_cluster": ("slurm",),
    "multinode_cluster": ("cluster",),
    "multinode_slurm": ("cluster", "slurm"),
}


# Under pytest-xdist (`make test` runs two workers, --dist loadgroup) every test that needs a
# scheduler or the multi-node cluster runs on one worker, one after another: they share the
# session's cluster fixtures and one SLURM, whose jobs would otherwise wait for each other's
# CPUs. Those tests mostly wait on the scheduler, so the other worker's CPU-bound tests run
# beside them.
SERVICES_GROUP = "services"


# tryfirst: pytest-xdist's own hook reads the xdist_group markers (it appends the group to the
# test ids), so the markers added here must be there before it runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items) -> None:
    unmarked = set()
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if HERE / "mpi" in path.parents:
            item.add_marker("mpi")
        for fixture in item.fixturenames:
            for kind in FIXTURE_KINDS.get(fixture, ()):
                item.add_marker(kind)
        if item.get_closest_marker("slurm") or item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.xdist_group(SERVICES_GROUP))
        if HERE / "unit" not in path.parents and not any(item.get_closest_marker(k) for k in KINDS):
            unmarked.add(path.relative_to(HERE.parent).as_posix())
    if unmarked:
        raise pytest.UsageError(
            f"{', '.join(sorted(unmarked))}: a test outside tests/unit/ needs one of the markers "
            f"{', '.join(KINDS)} (pytest.ini) so that `make test-unit` leaves it out; "
            "HINT: set pytestmark = pytest.mark.mpi (or what it needs) at the top of the module"
        )


# Inside a launch of tests/test_mpi_suites.py (several files per launch): every rank records
# what it collected and each test phase's outcome, read back by mpirun.file_verdicts.
_RESULTS = os.environ.get("HPCTRAIN_MPI_RESULTS") if os.environ.get("HPCTRAIN_MPI_CHILD") else None

if _RESULTS:
    _RANK = next((os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK") if v in os.environ), "0")

    def _record(*fields: str) -> None:
        with open(Path(_RESULTS) / f"rank{_RANK}.txt", "a") as out:  # appended as it happens: a crash keeps the lines
            out.write("\t".join(fields) + "\n")

    def pytest_collection_finish(session) -> None:
        for item in session.items:
            _record("collected", "-", item.nodeid)

    def pytest_runtest_logreport(report) -> None:
        _record(report.when, report.outcome, report.nodeid)
