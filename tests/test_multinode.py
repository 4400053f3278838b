"""Multi-node tests: real mpiexec across "nodes" of the local cluster (tests/cluster/).

Node1..node3 are network namespaces with their own hostnames, so MPI sees separate hosts and
talks TCP between them; these tests check what only shows across nodes. They skip with the
reason where the machine cannot run the cluster, and fail then when
HPCTRAIN_REQUIRE_MULTINODE=1 (CI). See docs/multinode.md.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import pytest

from cluster import multinode_cluster, python_argv, run_mpi_on_cluster  # noqa: F401 (fixture)

SCRIPTS = Path(__file__).resolve().parent / "cluster" / "scripts"

LAYOUTS = {
    "2x2": ("node1:2,node2:2", {0: "node1", 1: "node1", 2: "node2", 3: "node2"}),
    "3x1": ("node1,node2,node3", {0: "node1", 1: "node2", 2: "node3"}),
}


def tagged_lines(output: str, tag: str) -> List[Dict]:
    """The JSON objects the ranks printed after ``tag``."""
    rows = []
    for line in output.splitlines():
        if line.startswith(tag + " "):
            rows.append(json.loads(line[len(tag) + 1:]))
    return rows


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ranks_land_on_their_nodes(multinode_cluster, layout):
    spec, expected_host = LAYOUTS[layout]
    proc = run_mpi_on_cluster(spec, python_argv(str(SCRIPTS / "whereami.py")), timeout=60)
    assert proc.returncode == 0, proc.stdout
    rows = sorted(tagged_lines(proc.stdout, "WHEREAMI"), key=lambda r: r["rank"])
    n = len(expected_host)
    assert [r["rank"] for r in rows] == list(range(n)), proc.stdout
    per_node = n // len(set(expected_host.values()))
    for r in rows:
        assert r["size"] == n
        assert r["hostname"] == expected_host[r["rank"]], r
        assert r["processor_name"] == expected_host[r["rank"]], r
        # MPI's own idea of a node: only the ranks sharing the namespace share memory.
        assert r["node_size"] == per_node, r
        assert r["sum"] == n * (n + 1) // 2, r


def test_agent_maps_addresses_and_skips_ssh_options(multinode_cluster):
    from cluster import MPI_AGENT, run_on_node

    # Open MPI calls the agent like ssh: options, then the host (name or address), then the
    # command; the agent must land on the right node, wherever it is called from.
    proc = run_on_node("node1", [str(MPI_AGENT), "-x", "-o", "BatchMode=yes", "10.99.0.3", "hostname"])
    assert (proc.returncode, proc.stdout.strip()) == (0, "node3"), proc.stdout
    proc = run_on_node("node1", [str(MPI_AGENT), "root@node2", "cat /proc/sys/kernel/hostname"])
    assert (proc.returncode, proc.stdout.strip()) == (0, "node2"), proc.stdout


def test_start_again_is_a_no_op(multinode_cluster):
    from cluster import CLUSTER_SH, cluster_nodes
    import subprocess

    before = cluster_nodes()
    proc = subprocess.run(["bash", str(CLUSTER_SH), "start", "--nodes", str(len(before))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert cluster_nodes() == before


def test_hosts_spec_parsing():
    from cluster import parse_hosts_spec

    assert parse_hosts_spec("node1:2,node2:2") == [("node1", 2), ("node2", 2)]
    assert parse_hosts_spec("node1,node3") == [("node1", 1), ("node3", 1)]
    for bad in ("", "node1:0", "host1:2", "node1,node1", "node1:2:3"):
        with pytest.raises(ValueError):
            parse_hosts_spec(bad)


def test_skip_or_fail_policy(monkeypatch):
    from cluster import skip_or_fail

    monkeypatch.delenv("HPCTRAIN_REQUIRE_MULTINODE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no netns here"):
        skip_or_fail("no netns here")
    monkeypatch.setenv("HPCTRAIN_REQUIRE_MULTINODE", "1")
    with pytest.raises(pytest.fail.Exception, match="no netns here"):
        skip_or_fail("no netns here")


# --------------------------------------------------------------------------- hpctrain.comm across nodes
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_comm_across_nodes(multinode_cluster, layout):
    """tests/cluster/mpi_checks.py under mpiexec: topology, every all-reduce algorithm vs
    MPI_Allreduce, shared memory confined to a node, auto's choice, sub-groups."""
    spec, _ = LAYOUTS[layout]
    proc = run_mpi_on_cluster(
        spec,
        python_argv("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--color=no",
                    str(Path("tests") / "cluster" / "mpi_checks.py")),
        timeout=240,
        env={"HPCTRAIN_MPI_CHILD": "1", "HPCTRAIN_STALL_TIMEOUT": "60", "HPCTRAIN_TEST_LAYOUT": spec},
    )
    assert proc.returncode == 0, f"mpi_checks.py at {layout} ({spec}) failed, rc={proc.returncode}:\n{proc.stdout[-12000:]}"
