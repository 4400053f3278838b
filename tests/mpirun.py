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
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent


def mpiexec_argv(n: int, extra: Sequence[str] = ()) -> List[str]:
    from hpctrain.cli.launch import find_mpiexec, launcher_flags

    exe = find_mpiexec()
    return [exe, "-n", str(n), *launcher_flags(exe), *extra]


def mpi_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("HPCTRAIN_STALL_TIMEOUT", "60")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    if extra:
        env.update(extra)
    return env


def run_mpi(
    n: int,
    argv: Sequence[str],
    timeout: float = 120,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[Path] = None,
) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``n`` ranks; return the completed process (never raises on rc != 0).

    A run that outlives ``timeout`` is killed (the whole process group) and reported with
    returncode -9 and whatever it printed.
    """
    cmd = mpiexec_argv(n) + list(argv)
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
