"""The local multi-node test cluster, from Python: availability, a pytest fixture, MPI runs.

``tests/cluster/cluster.sh`` makes N "nodes" out of network namespaces with their own
hostnames (node1 … nodeN on 10.99.0.0/24); MPI and SLURM treat them as separate hosts. This
module is what the tests use::

    from cluster import multinode_cluster, run_mpi_on_cluster   # fixture + runner

    def test_x(multinode_cluster):
        proc = run_mpi_on_cluster("node1:2,node2:2", python_argv("script.py"), timeout=60)
        assert proc.returncode == 0, proc.stdout

``mpiexec`` runs *inside* node1 (as on a head node: from the root namespace the remote
daemons cannot call back) and starts its daemons on the other nodes through
``tests/cluster/mpi-agent`` instead of ssh.

Where the cluster cannot run (not root, no network namespaces, no Open MPI 5) the tests skip
with the reason; with ``HPCTRAIN_REQUIRE_MULTINODE=1`` they fail instead.
"""
from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

import require

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CLUSTER_SH = HERE / "cluster.sh"
RUN_ON_NODE = HERE / "run-on-node"
MPI_AGENT = HERE / "mpi-agent"
SLURM_CLUSTER_SH = HERE / "slurm-cluster.sh"
STATE_DIR = Path(os.environ.get("HPCTRAIN_CLUSTER_DIR", "/run/hpctrain-cluster"))
SLURM_CONF = STATE_DIR / "slurm" / "slurm.conf"
NODES_NEEDED = 3  # the tests use 2 × 2 (node1, node2) and 3 × 1 (node1..node3)

_HOSTS_ITEM = re.compile(r"^(node[1-9][0-9]?)(?::([1-9][0-9]*))?$")


def skip_or_fail(reason: str, request: Optional[pytest.FixtureRequest] = None) -> None:
    """Skip the calling test with ``reason``, or fail it when multi-node runs are required."""
    require.skip_or_fail("multinode", f"multi-node cluster unavailable: {reason}", request)


def _mpiexec() -> str:
    from hpctrain.cli.launch import find_mpiexec

    return find_mpiexec()


@functools.lru_cache(maxsize=None)
def cluster_available() -> Tuple[bool, str]:
    """Whether this machine can run the local cluster and MPI on it: ``(ok, reason)``."""
    try:
        check = subprocess.run(
            ["bash", str(CLUSTER_SH), "check"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{CLUSTER_SH} check did not run: {exc}"
    if check.returncode != 0:
        return False, (check.stdout + check.stderr).strip() or f"{CLUSTER_SH} check exited {check.returncode}"
    try:
        exe = _mpiexec()
    except SystemExit as exc:
        return False, str(exc)
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{exe} --version failed: {exc}"
    text = out.stdout + out.stderr
    match = re.search(r"Open MPI\)?\s+(\d+)\.", text)
    if not match or int(match.group(1)) < 5:
        first = text.strip().splitlines()[0] if text.strip() else "(nothing)"
        return False, (
            f"{exe} is not Open MPI 5 (it printed {first!r}); the cluster's launcher shim needs "
            "Open MPI 5's plm_ssh_agent. HINT: set HPCTRAIN_MPIEXEC to an Open MPI 5 mpiexec"
        )
    return True, "ok"


def cluster_nodes() -> List[str]:
    """Nodes of the running cluster (empty when it is down)."""
    proc = subprocess.run(["bash", str(CLUSTER_SH), "status"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return []
    return [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("node") and line.endswith(" up")]


def start_cluster(nodes: int) -> None:
    """Start (or grow to) ``nodes`` nodes; raises RuntimeError with the script's output."""
    proc = subprocess.run(
        ["bash", str(CLUSTER_SH), "start", "--nodes", str(nodes)],
        capture_output=True, text=True, timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"cluster.sh start --nodes {nodes} failed:\n{proc.stdout}{proc.stderr}")


def stop_cluster() -> None:
    """Tear the cluster down (every namespace, the bridge and daemons it recorded)."""
    proc = subprocess.run(["bash", str(CLUSTER_SH), "stop"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"cluster.sh stop failed:\n{proc.stdout}{proc.stderr}")


def parse_hosts_spec(hosts_spec: str) -> List[Tuple[str, int]]:
    """``"node1:2,node2:2"`` -> ``[("node1", 2), ("node2", 2)]`` (a bare node means 1 slot)."""
    items = []
    for part in hosts_spec.split(","):
        match = _HOSTS_ITEM.match(part.strip())
        if not match:
            raise ValueError(
                f"bad hosts spec item {part!r} in {hosts_spec!r}; expected e.g. 'node1:2,node2:2'"
            )
        items.append((match.group(1), int(match.group(2) or 1)))
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"hosts spec {hosts_spec!r} names a node twice")
    return items


def cluster_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for commands on the cluster: the repository's venv and source, as-root vars."""
    from mpirun import mpi_env  # tests/mpirun.py: PATH, PYTHONPATH, as-root, OMP threads

    env = mpi_env(None)
    env["PRTE_MCA_plm_ssh_agent"] = str(MPI_AGENT)
    # Every "node" is this machine's cores: ranks of all nodes together oversubscribe them,
    # which Open MPI cannot see from one node's slot count, so tell it to yield when idle.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    if extra:
        env.update(extra)
    return env


def mpiexec_on_cluster_argv(hosts_spec: str, argv: Sequence[str]) -> List[str]:
    """The full command line: run-on-node node1 mpiexec -n N --host SPEC … argv."""
    items = parse_hosts_spec(hosts_spec)
    n = sum(slots for _, slots in items)
    spec = ",".join(f"{name}:{slots}" for name, slots in items)
    return [
        str(RUN_ON_NODE), "node1",
        _mpiexec(), "-n", str(n), "--host", spec,
        "--bind-to", "none",  # every "node" sees the same cores; binding piles ranks on core 0
        "--oversubscribe",
        "--prtemca", "plm_ssh_agent", str(MPI_AGENT),
        *argv,
    ]


# Open MPI 5.0's mpiexec can stay after an MPI_Abort across nodes, every rank gone (two ranks
# on two nodes aborting at once; docs/multinode.md): once it has reported the abort and no
# rank of the job is left, it is ended after this long, as `hpctrain launch` does.
LINGER_AFTER_ABORT_S = 10.0


def _run_killing_tree(cmd: Sequence[str], timeout: float, env: Dict[str, str], cwd: Path,
                      rank_argv: Optional[Sequence[str]] = None) -> subprocess.CompletedProcess:
    from hpctrain.cli.launch import AbortReport
    import time

    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, cwd=str(cwd), start_new_session=True,
    )
    report = AbortReport(grace=LINGER_AFTER_ABORT_S)
    lines: List[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            report.feed(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if rank_argv and report() and not _ranks_alive(rank_argv):
            _kill_tree(proc.pid)
            proc.wait()
            reader.join(timeout=10)
            note = (f"\n[mpiexec still ran {LINGER_AFTER_ABORT_S:g} s after it reported rank {report.rank}'s "
                    "MPI_Abort, no rank of the job left: ended by the test helper]")
            return subprocess.CompletedProcess(list(cmd), report.exit_status(), "".join(lines) + note, "")
        time.sleep(0.5)
    if proc.poll() is None:
        _kill_tree(proc.pid)
        proc.wait()
        reader.join(timeout=10)
        return subprocess.CompletedProcess(list(cmd), -9, "".join(lines) + f"\n[killed after {timeout}s]", "")
    reader.join()
    return subprocess.CompletedProcess(list(cmd), proc.returncode, "".join(lines), "")


def _ranks_alive(rank_argv: Sequence[str]) -> bool:
    """Whether a process runs ``rank_argv`` (its command line ends with everything after the
    program: ranks on every node, the namespaces share one process table)."""
    import psutil
    from hpctrain.cli.launch import is_launcher

    tail = list(rank_argv[1:])
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        launcher = any(is_launcher(os.path.basename(arg)) or arg == str(RUN_ON_NODE) for arg in cmdline)
        if tail and cmdline[-len(tail):] == tail and not launcher:
            return True
    return False


def _kill_tree(pid: int) -> None:
    """Kill ``pid`` and every descendant (remote daemons run under the agent, not our group)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_mpi_on_cluster(
    hosts_spec: str,
    argv: Sequence[str],
    timeout: float = 120,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[Path] = None,
) -> subprocess.CompletedProcess:
    """Run ``argv`` under mpiexec across cluster nodes, e.g. ``hosts_spec="node1:2,node2:2"``.

    Ranks are placed in the order of the spec (node1's slots first). Returns the completed
    process with stdout and stderr merged; never raises on rc != 0. A run that outlives
    ``timeout`` is killed (with the daemons on every node) and returns rc -9; one whose
    mpiexec stays after reporting an MPI_Abort, every rank gone, is ended LINGER_AFTER_ABORT_S
    later and returns the abort's code (a note at the end of its output says so).
    """
    cmd = mpiexec_on_cluster_argv(hosts_spec, argv)
    return _run_killing_tree(cmd, timeout, cluster_env(env), cwd or ROOT, rank_argv=argv)


def run_on_node(
    node: str, argv: Sequence[str], timeout: float = 60, env: Optional[Dict[str, str]] = None
) -> subprocess.CompletedProcess:
    """Run one command on one node (its hostname, network and hosts file)."""
    return _run_killing_tree([str(RUN_ON_NODE), node, *argv], timeout, cluster_env(env), ROOT)


def python_argv(*args: str) -> List[str]:
    """``[sys.executable, *args]`` — the venv's Python, the same path on every node."""
    return [sys.executable, *args]


# One cluster shared by every test session on the machine. Each session registers its pid
# under STATE_DIR/users while it uses the cluster; a cluster a fixture started carries the
# marker STATE_DIR/fixture-owned and is stopped by the last session to leave (so two pytest
# runs at once do not pull the nodes from under each other). A cluster started by hand has no
# marker and is left up. Within one process the fixture may exist once per importing module:
# a counter makes those share one registration.
_lock = threading.Lock()
_users = 0


def _fixture_lock():
    import fcntl

    STATE_DIR.parent.mkdir(parents=True, exist_ok=True)
    handle = open(STATE_DIR.parent / "hpctrain-cluster.fixture.lock", "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle  # closing it releases the lock


def _live_users() -> List[int]:
    users = STATE_DIR / "users"
    alive = []
    for entry in users.glob("*") if users.is_dir() else []:
        try:
            pid = int(entry.name)
            os.kill(pid, 0)
            alive.append(pid)
        except (ValueError, ProcessLookupError):
            entry.unlink(missing_ok=True)
        except PermissionError:
            alive.append(int(entry.name))
    return alive


def _acquire(nodes: int) -> List[str]:
    global _users
    with _lock:
        if _users == 0:
            with _fixture_lock():
                present = cluster_nodes()
                if len(present) < nodes:
                    start_cluster(nodes)
                    if not present:
                        (STATE_DIR / "fixture-owned").touch()
                (STATE_DIR / "users").mkdir(exist_ok=True)
                (STATE_DIR / "users" / str(os.getpid())).touch()
        _users += 1
        return cluster_nodes()


def _release() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users:
            return
        with _fixture_lock():
            (STATE_DIR / "users" / str(os.getpid())).unlink(missing_ok=True)
            if (
                not _live_users()
                and (STATE_DIR / "fixture-owned").exists()
                and not os.environ.get("HPCTRAIN_KEEP_CLUSTER")
            ):
                stop_cluster()


@pytest.fixture(scope="session")
def multinode_cluster(request: pytest.FixtureRequest) -> Iterator[List[str]]:
    """Start the local cluster (node1..node3) for this session; yields the node names.

    Skips with the reason where the machine cannot run it (fails when
    ``HPCTRAIN_REQUIRE_MULTINODE=1``). A cluster started by hand is reused and left up; one a
    fixture started is stopped by the last test session using it (``HPCTRAIN_KEEP_CLUSTER=1``
    keeps it).
    """
    ok, reason = cluster_available()
    if not ok:
        skip_or_fail(reason, request)
    try:
        nodes = _acquire(NODES_NEEDED)
    except RuntimeError as exc:
        skip_or_fail(str(exc), request)
    try:
        yield nodes
    finally:
        _release()


# --------------------------------------------------------------------------- multi-node SLURM
def slurm_unavailable_reason() -> Optional[str]:
    """None when this machine has what the multi-node SLURM needs; otherwise why not."""
    proc = subprocess.run(["bash", str(SLURM_CLUSTER_SH), "check"], capture_output=True, text=True, timeout=30)
    return None if proc.returncode == 0 else (proc.stdout + proc.stderr).strip()


def slurm_on_cluster(argv: Sequence[str], timeout: float = 60, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """A SLURM client command (sbatch, squeue, scontrol, hpctrain slurm submit …) on node1,
    the cluster's login node, with this cluster's ``SLURM_CONF``."""
    return run_on_node("node1", argv, timeout=timeout, env={"SLURM_CONF": str(SLURM_CONF), **(env or {})})


def job_info_on_cluster(job_id: int) -> Dict[str, str]:
    """``scontrol show job -o ID`` as a dict (empty when SLURM no longer knows the job)."""
    proc = slurm_on_cluster(["scontrol", "show", "job", "-o", str(job_id)], timeout=30)
    info: Dict[str, str] = {}
    if proc.returncode != 0:
        return info
    for word in proc.stdout.split():
        key, sep, value = word.partition("=")
        if sep and key not in info:
            info[key] = value
    return info


def wait_job_on_cluster(job_id: int, timeout: float = 120) -> Dict[str, str]:
    """Poll until the job ends; returns its scontrol record (JobState COMPLETED, FAILED, …).
    Cancels it and returns the last record (JobState as seen) when ``timeout`` passes."""
    import time

    deadline = time.monotonic() + timeout
    info: Dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info_on_cluster(job_id)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"):
            return info
        time.sleep(0.5)
    slurm_on_cluster(["scancel", str(job_id)], timeout=30)
    info = dict(info)
    info["TimedOut"] = f"still {info.get('JobState')} after {timeout}s; cancelled"
    return info


@pytest.fixture(scope="session")
def multinode_slurm(multinode_cluster, request: pytest.FixtureRequest) -> Iterator[List[str]]:
    """slurmctld on node1 and a slurmd on every node of the cluster (node1..node3), with this
    cluster's own SLURM_CONF and munged. Yields the node names; clients go through
    ``slurm_on_cluster``. Skips (or fails, with HPCTRAIN_REQUIRE_MULTINODE=1) without SLURM."""
    reason = slurm_unavailable_reason()
    if reason:
        skip_or_fail(f"multi-node SLURM: {reason}", request)
    # Idempotent: a running SLURM with an unchanged configuration is left as it is.
    proc = subprocess.run(["bash", str(CLUSTER_SH), "start", "--nodes", str(len(multinode_cluster)), "--slurm"],
                          capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        skip_or_fail(f"multi-node SLURM did not start:\n{proc.stdout}{proc.stderr}", request)
    yield multinode_cluster
    # SLURM stops with the cluster (cluster.sh stop), when the last session leaves it.

