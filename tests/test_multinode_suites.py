"""Existing multi-rank suites (tests/mpi/) re-run across nodes of the local cluster at 2 × 2.

tests/test_mpi_suites.py runs them with every rank on one host; here ranks 0–1 sit on node1
and 2–3 on node2, so node-local assumptions (shared scratch paths, local vs. cross rank, shared
memory) are exercised. Kept apart from tests/test_multinode.py because these take longer
(about a minute each on a quiet 2-core machine). Skips/fails like the other multi-node tests.
"""
from __future__ import annotations

import pytest

from cluster import multinode_cluster, python_argv, run_mpi_on_cluster  # noqa: F401 (fixture)
from mpirun import CHILD_ENV, CHILD_PYTEST

pytestmark = [pytest.mark.cluster, pytest.mark.mpi, pytest.mark.slow]

SUITES = {
    # id: (file, extra pytest arguments)
    "data_loader": ("tests/mpi/test_data_loader.py", []),
    # the agreement check (node trees, leaders across) and small all-reduces riding on it, over TCP
    "agreement": ("tests/mpi/test_comm_agreement_mpi.py", []),
    # the same with every rank in the recursive doubling (HPCTRAIN_CHECK_SCHEDULE=flat)
    "agreement_flat": ("tests/mpi/test_comm_agreement_mpi.py", [], {"HPCTRAIN_CHECK_SCHEDULE": "flat"}),
    "torch_optimizer_equivalence": ("tests/mpi/test_torch_optimizer.py", ["-k", "equivalence"]),
    # gradient buckets in each node's shared window: in-band small ones, hierarchical large ones
    "torch_shared_buckets": ("tests/mpi/test_torch_shared_buckets.py", []),
}


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_mpi_suite_at_2x2(multinode_cluster, suite):
    path, extra, *env = SUITES[suite]
    proc = run_mpi_on_cluster(
        "node1:2,node2:2",
        python_argv(*CHILD_PYTEST, "--color=no", path, *extra),
        timeout=300,
        env={**CHILD_ENV, **(env[0] if env else {})},
    )
    assert proc.returncode == 0, f"{path} {' '.join(extra)} across node1:2,node2:2 failed (rc={proc.returncode}):\n{proc.stdout[-10000:]}"
