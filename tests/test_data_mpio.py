"""The loader's parallel-HDF5 path (``driver="mpio"``) under a real mpiexec, in the private
environment built by ``tests/mpio/setup-env.sh`` (Debian's h5py-mpi, mpi4py and Open MPI;
the main .venv's PyPI h5py is serial, so this path cannot run there).

Skips with the reason when that environment is absent; fails instead when
``HPCTRAIN_REQUIRE_MPIO=1``.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from require import skip_or_fail

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
ENV_DIR = Path(os.environ.get("HPCTRAIN_MPIO_ENV") or Path.home() / ".cache" / "hpctrain" / "mpio-env")


def mpio_env() -> Path:
    """The ready environment, or skip (fail when HPCTRAIN_REQUIRE_MPIO=1)."""
    if (ENV_DIR / ".complete").is_file() and (ENV_DIR / "bin" / "mpiexec").is_file():
        return ENV_DIR
    why = (f"no parallel-HDF5 environment at {ENV_DIR} (HPCTRAIN_MPIO_ENV); "
           f"build it with tests/mpio/setup-env.sh (about 1-2 min)")
    skip_or_fail("mpio", why)


def run(argv, timeout: float) -> subprocess.CompletedProcess:
    # Nothing of an outer launcher (the main venv's Open MPI/PMIx) may leak into this one.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "OPAL_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["HPCTRAIN_STALL_TIMEOUT"] = "60"
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(ROOT), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[killed after {timeout} s]"
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def test_loader_mpio_two_ranks(tmp_path):
    d = mpio_env()
    res = run([str(d / "bin" / "mpiexec"), "-n", "2", str(d / "bin" / "python"),
               str(ROOT / "tests" / "mpio" / "loader_ranks.py"), str(tmp_path)], timeout=300)
    assert res.returncode == 0 and "MPIO-LOADER-OK 2" in res.stdout, res.stdout[-6000:]


def test_loader_unit_mpio_in_process():
    """tests/unit's in-process mpio test, which skips in the main .venv, run where it can."""
    d = mpio_env()
    res = run([str(d / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "tests/unit/test_data_loader.py", "-k", "mpio", "-rs"], timeout=300)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-6000:]
