"""Launch commands under a real ``mpiexec`` from tests, with a timeout.

The launcher is ``$HPCTRAIN_MPIEXEC`` or the ``mpiexec`` next to this Python (the PyPI Open
MPI wheel in .venv) or on PATH. Open MPI gets ``--oversubscribe`` (more ranks than cores) and
``--bind-to none``; as root, its two run-as-root variables are set.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent


def mpiexec_argv(n: int, extra: Sequence[str] = ()) -> List[str]:
    from hpctrain.cli.launch import find_mpiexec, launcher_flags

    exe = find_mpiexec()
    return [exe, "-n", str(n), *launcher_flags(exe), *extra]


def mpi_env(extra: Optional[Dict[str, Optional[str]]] = None) -> Dict[str, str]:
    """The launch's environment: this process's, the MPI test settings, then ``extra`` (a
    value of None removes the variable)."""
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("HPCTRAIN_STALL_TIMEOUT", "60")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    # The suite runs several launches at once on few cores: a rank that waits in Open MPI's
    # progress loop yields its core to the rank it waits for (two 2-rank launches side by side:
    # 10% less CPU, 12% less wall). Other MPIs ignore the variable.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    for name, value in (extra or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_mpi(
    n: int,
    argv: Sequence[str],
    timeout: float = 120,
    env: Optional[Dict[str, Optional[str]]] = None,
    cwd: Optional[Path] = None,
) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``n`` ranks; return the completed process (never raises on rc != 0).

    A run that outlives ``timeout`` is killed (the whole process group) and reported with
    returncode -9 and whatever it printed.
    """
    return run_command(mpiexec_argv(n) + list(argv), timeout, env, cwd)


def run_command(cmd: Sequence[str], timeout: float = 120, env: Optional[Dict[str, Optional[str]]] = None,
                cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run a launcher command (``cmd``: mpiexec or ``hpctrain launch`` …) as ``run_mpi`` does:
    output merged, the MPI test environment, killed with its process group after ``timeout``."""
    cmd = list(cmd)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=mpi_env(env),
        cwd=str(cwd or ROOT),
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(cmd, -9, (out or "") + f"\n[killed after {timeout}s]", "")


def python_argv(*args: str) -> List[str]:
    return [sys.executable, *args]


# pytest inside a launch (tests/mpi/ files, one process per rank). Plugins are not auto-loaded:
# scanning the installed packages' entry points and importing their plugins costs each rank
# ~1.5 s of CPU, and the ranks need none of them (the launching test enforces the timeout;
# pytest_timeout is loaded only because pytest.ini sets its option).
CHILD_PYTEST = ("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "pytest_timeout")
CHILD_ENV = {"HPCTRAIN_MPI_CHILD": "1", "HPCTRAIN_STALL_TIMEOUT": "60", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def report_past_capture(request, text: str) -> None:
    """Print past pytest's output capture (a skip reason is otherwise shown only with -rs)."""
    if request is None:
        return
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(text)


# One launch runs several tests/mpi/ files (tests/test_mpi_suites.py): starting Python, torch
# and pytest costs each rank ~6 s of CPU, more than most files' tests. Each rank of such a launch
# writes one line per collected test and per test phase to $RESULTS_ENV/rank<R>.txt
# (tests/conftest.py), and `file_verdicts` turns those lines back into one verdict per file.
RESULTS_ENV = "HPCTRAIN_MPI_RESULTS"


def read_results(folder: Path) -> Dict[str, List[Tuple[str, str, str]]]:
    """rank file name → its (phase or "collected", outcome, node id) lines, in order."""
    out = {}
    for path in sorted(Path(folder).glob("rank*.txt")):
        out[path.stem] = [tuple(line.split("\t", 2)) for line in path.read_text().splitlines() if line.count("\t") == 2]
    return out


def file_verdicts(files: Sequence[str], results: Dict[str, List[Tuple[str, str, str]]], ranks: int,
                  returncode: int) -> Dict[str, Optional[str]]:
    """For each of ``files`` (node-id prefixes, e.g. "tests/mpi/test_x.py") run by one launch of
    ``ranks`` ranks: None when every rank ran each of its collected tests and none failed,
    otherwise why not. A launch that failed after every test passed (a crash at exit) is
    charged to the last file, so that it cannot go unnoticed."""
    collected: Dict[str, List[str]] = {}
    failed: Dict[str, List[str]] = {}
    done: Dict[str, set] = {}
    for rank, lines in results.items():
        finished = done.setdefault(rank, set())
        for phase, outcome, nodeid in lines:
            if phase == "collected":
                collected.setdefault(nodeid, [])
            elif outcome == "failed":
                failed.setdefault(nodeid, []).append(rank)
            elif outcome == "skipped" or (phase == "call" and outcome == "passed"):
                finished.add(nodeid)
    first_failure = next(iter(failed), None)
    stopped = f"the launch stopped (rc={returncode})" + (f" after {first_failure} failed" if first_failure else "")
    verdicts: Dict[str, Optional[str]] = {}
    for file in files:
        mine = [n for n in collected if n.split("::", 1)[0] == file]
        bad = [f"{n} failed on {', '.join(sorted(r))}" for n, r in failed.items() if n.split("::", 1)[0] == file]
        silent = [f"rank{r}" for r in range(ranks) if f"rank{r}" not in results]
        unfinished = sorted({n for n in mine for rank in done if n not in done[rank]})
        if bad:
            verdicts[file] = "; ".join(bad)
        elif silent and not mine:
            verdicts[file] = f"{', '.join(silent)} recorded nothing: {stopped}"
        elif not mine:
            verdicts[file] = f"no test of it was collected: {stopped}"
        elif unfinished or silent:
            verdicts[file] = f"{len(unfinished)} of its {len(mine)} tests did not finish on every rank: {stopped}"
        else:
            verdicts[file] = None
    if returncode != 0 and files and all(v is None for v in verdicts.values()):
        verdicts[files[-1]] = f"every test passed but the launch exited with rc={returncode}"
    return verdicts
