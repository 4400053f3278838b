"""MPI start-up, process groups and their topology. The only module that imports mpi4py
(together with the algorithm modules of this package)."""
from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
import weakref
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from .. import settings
from . import asyncq, finished, guard, launcher
from .asyncq import drain
from .errors import CommError, ElasticError, NotInitializedError, RanksLostError
from .guard import agree, make_header
from .plan import Topology, check_schedule, topology_from_keys
from .watchdog import Watchdog, launcher_parent, stall_timeout

# "base": the communicator the world group is built on: MPI_COMM_WORLD, or the survivors'
# communicator after an elastic job lost ranks ("generation" counts those re-formings).
# "groups": every live Group (elastic jobs revoke them all on a failure).
# "launched": the launched (MPI_COMM_WORLD) rank of each rank of a re-formed world.
_state: dict = {"world": None, "watchdog": None, "MPI": None, "finalize": False, "base": None,
                "generation": 0, "groups": weakref.WeakSet(), "reform_hooks": [], "reforms": [], "launched": [],
                "notices": None, "announce_registered": False}
_init_lock = threading.Lock()


def _mpi():
    MPI = _state["MPI"]
    if MPI is None:
        raise NotInitializedError(
            "hpctrain.comm is not initialized. HINT: call hpctrain.comm.init() (or hvd.init()) first."
        )
    return MPI


class Group:
    """A set of ranks that run collectives together (``world()``, ``new_group``, ``split``).

    Holds the MPI communicators it needs: one for native collectives, duplicates for ring
    traffic, point-to-point messages and header checks (so they never match each other's
    messages), the node-local communicator and the cross-node one.
    """

    def __init__(self, mpi_comm: Any, name: str) -> None:
        MPI = _mpi()
        self.name = name
        self.comm = mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        world_rank = (_state["base"] or MPI.COMM_WORLD).Get_rank()
        self.ranks: List[int] = mpi_comm.allgather(world_rank)
        self.ring_comm = mpi_comm.Dup()
        self.p2p_comm = mpi_comm.Dup()
        self.ctl_comm = mpi_comm.Dup()
        self.node_comm = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        leader = self.node_comm.bcast(world_rank, root=0)
        # auto's thresholds across nodes (plan.choose_algorithm), read once per group and agreed
        # in the same allgather (rank 0's win): a rank with other HPCTRAIN_CROSS_NODE_* values must
        # not route the same call differently (with the check off, mismatched collectives hang).
        # Whether auto tunes at run time across nodes (HPCTRAIN_AUTOTUNE) is agreed here too.
        from . import tuning

        mine = (settings.rc.cross_node_ring_bytes, settings.rc.cross_node_hierarchical_bytes, tuning.enabled(),
                settings.rc.check_inband_bytes, settings.rc.check_schedule)
        facts = mpi_comm.allgather((leader, mine))
        self.topology: Topology = topology_from_keys([f[0] for f in facts])
        self.cross_node = tuple(facts[0][1][:2])
        tune_across_nodes = bool(facts[0][1][2])
        self.local_rank: int = self.node_comm.Get_rank()
        self.local_size: int = self.node_comm.Get_size()
        self.cross_rank: int = self.topology.cross_rank(self.rank)
        self.cross_size: int = self.topology.cross_size
        # Ranks with the same local rank on every node: the inter-node ring of the
        # hierarchical all-reduce.
        self.cross_comm = mpi_comm.Split(color=self.local_rank, key=self.rank)
        self.cross_ring_comm = self.cross_comm.Dup()
        self.seq = 0  # collectives entered, identical on every rank when they agree
        self.check_io = None  # the agreement check's buffers over MPI (guard.CheckIO), made on first use
        # Flag synchronisation among this group's ranks on this node (None: one local rank,
        # or the C extension missing). On a one-node group it also runs the agreement check
        # and small all-reduces.
        from .shmsync import NodeFlags

        self.node_flags = NodeFlags.create(self.node_comm)
        self.small_shm = self.node_flags.small_bytes if self.node_flags and self.topology.single_node else 0
        # Largest all-reduce whose data rides on the agreement check over MPI (none where the
        # check is a flag exchange); from rank 0's HPCTRAIN_CHECK_INBAND_BYTES, agreed above:
        # ranks with different limits would send a call's data in different messages, and the
        # receive buffers are sized by it.
        # whom this rank swaps its part of the agreement check over MPI with: across nodes the
        # node's ranks fold into its leader, and only the leaders' messages cross the network
        # (HPCTRAIN_CHECK_SCHEDULE=flat: every rank in the recursive doubling); rank 0's choice
        nodes = self.topology.node_of if facts[0][1][4] == "leaders" else None
        self.inband = 0 if self.small_shm else guard.inband_limit(facts[0][1][3], self.size, nodes)
        self.check_schedule = check_schedule(self.rank, self.size, nodes) if self.size > 1 else None
        self.shm_arena = None  # created on first shared-memory use
        self.shared_buffers: list = []  # zero-copy buffers allocated on this group
        # auto's run-time choice (collectives._tuned_call). On one node: on when every rank
        # has it on (HPCTRAIN_AUTOTUNE), so that all take the same path; the tuner lives on
        # local rank 0, which sends its pick through this one-element array. Across nodes:
        # rank 0's setting (agreed above); the tuner lives on group rank 0, whose pick rides on
        # the agreement check's verdict.
        if self.topology.single_node:
            self.autotune = (self.node_flags is not None
                             and self.node_comm.allreduce(int(tuning.enabled()), op=MPI.MIN) == 1)
        else:
            self.autotune = tune_across_nodes
        self.tuner = None
        self.tuned_choice = np.zeros(1, dtype=np.int64)
        self.tuned_runs: dict = {}  # size class key -> [candidate index, calls left in the run] (every rank)
        # all-reduce decisions, made once per kind of call (their inputs are this group's fixed
        # facts): (nbytes, dtype, op, check on) -> the lean path's collectives._Lean, ("route",
        # nbytes, dtype name, requested algorithm, shared) -> plan.Route (collectives._route), a checked native
        # call's header, its guard.InbandCall or its check (collectives._checked_native), and
        # ("decision", op, dtype name, count word) -> a tuned call's header and DecisionCheck
        self.routes: dict = {}
        # Ranks that called join() and now stand in for zeros in the others' all-reduces, in
        # the order they joined (the same list on every rank: read from shared agreement
        # headers); empty outside a join (comm/joining.py).
        self.joined: List[int] = []
        self._lock = threading.RLock()
        _state["groups"].add(self)

    def __repr__(self) -> str:
        return f"Group({self.name}, rank {self.rank}/{self.size}, nodes {self.cross_size})"

    def world_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def describe_ranks(self, group_ranks: Sequence[int]) -> str:
        if not group_ranks:
            return "none"
        if self.name == "world":
            return "ranks " + ", ".join(str(r) for r in group_ranks)
        return "ranks " + ", ".join(f"{r} (world rank {self.ranks[r]})" for r in group_ranks)

    def _comms(self) -> list:
        return [self.comm, self.ring_comm, self.p2p_comm, self.ctl_comm, self.node_comm, self.cross_comm,
                self.cross_ring_comm]

    def abandon(self) -> None:
        """Leave this group after a lost rank (elastic jobs): revoke its communicators and mark
        this rank's flag slot abandoned, so that every survivor blocked in one of its
        collectives (MPI or shared memory) gets RanksLostError. Nothing is freed: freeing is
        collective over ranks that may be dead; the memory goes with the process."""
        if self.node_flags is not None:
            self.node_flags.abandon()
        for c in self._comms():
            try:
                c.Revoke()
            except Exception:  # already revoked, or an MPI without the extension
                pass

    def free(self) -> None:
        for sbuf in self.shared_buffers:
            sbuf.free()
        self.shared_buffers = []
        if self.shm_arena is not None:
            self.shm_arena.free()
            self.shm_arena = None
        if self.node_flags is not None:
            self.node_flags.free()
            self.node_flags = None
            self.small_shm = 0
            self.routes = {}  # decided with the flags
        self.check_io = None
        for c in self._comms()[1:]:
            try:
                c.Free()
            except Exception:
                pass


# --------------------------------------------------------------------------- init
def init(check_slurm: bool = True) -> "Group":
    """Start MPI (idempotent) and return the world group.

    Works under mpiexec/mpirun, ``srun --mpi=pmix`` and as a plain single process. Under a
    direct srun launch, a world size that differs from SLURM's task count is an error.
    """
    with _init_lock:
        if _state["world"] is not None:
            return _state["world"]
        settings.check_all()  # a bad HPCTRAIN_* value stops every rank here, before any MPI call
        guard.load_setting()
        from mpi4py import MPI  # thread level and osc default: set in hpctrain/comm/__init__.py

        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
            _state["finalize"] = True
        _state["MPI"] = MPI
        if check_slurm:
            launcher.check_world_size(os.environ, MPI.COMM_WORLD.Get_size())
            launcher.check_non_mpi_launcher(os.environ, MPI.COMM_WORLD.Get_size())
        if settings.rc.elastic:
            _start_fault_tolerance(MPI)
        _state["base"] = MPI.COMM_WORLD
        _state["launched"] = list(range(MPI.COMM_WORLD.Get_size()))
        world = Group(MPI.COMM_WORLD, "world")
        _state["world"] = world
        dog = Watchdog(world.rank, abort_job, stall_timeout(), launcher_parent() if world.size > 1 else None)
        if world.size > 1:
            if not settings.rc.elastic:  # an elastic world re-forms: its lost ranks are faults' to handle
                _listen_for_ended_ranks(MPI, world, dog)
            dog.start()
            _install_excepthook()
        _state["watchdog"] = dog
        return world


def _listen_for_ended_ranks(MPI: Any, world: Group, dog: Watchdog) -> None:
    """Tell the other ranks when this one ends, and watch for those that end while this one
    waits (finished.py). The watchdog's probe is an MPI call from its own thread: only with
    MPI_THREAD_MULTIPLE."""
    import atexit

    notices = finished.Notices(MPI.COMM_WORLD.Dup(), world.rank, world.size)
    _state["notices"] = notices
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        dog.listen(notices, lambda: world.seq, asyncq.foreground_blocked)
    if not _state["announce_registered"]:
        atexit.register(_announce_end)
        _state["announce_registered"] = True


def _announce_end() -> None:
    """At shutdown or a normal exit: this rank's notice, with its count of world collectives."""
    notices, world = _state["notices"], _state["world"]
    if notices is not None and world is not None:
        notices.announce(world.seq)


def _start_fault_tolerance(MPI) -> None:
    """Elastic jobs: refuse to start where a lost rank could not be survived (the job would
    end at the first failure, which is what the user turned elastic mode on to avoid), and
    make every MPI error a Python exception (mpi4py's default on MPI_COMM_WORLD, which every
    hpctrain communicator inherits; set again in case a user changed it)."""
    from . import faults

    ok, why = faults.support()
    if not ok:
        raise ElasticError(f"HPCTRAIN_ELASTIC=1, but this job cannot survive a lost rank: {why}.\n"
                           f"{faults.HOW_TO_ENABLE}; or unset HPCTRAIN_ELASTIC")
    MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)
    faults.install(_abandon_all)
    import atexit

    atexit.register(_at_exit)


def _abandon_all() -> None:
    for g in list(_state["groups"]):
        g.abandon()


def note_reform(**info: Any) -> None:
    """Add facts to the last re-forming's record (the elastic layer adds the committed step
    it resumed from); they reach ``reforms()`` and the launcher's report."""
    if _state["reforms"]:
        _state["reforms"][-1].update(info)


def _at_exit() -> None:
    """Elastic jobs, at a rank's normal exit: its report for ``hpctrain launch --elastic``,
    then, after a re-forming, the exit without MPI_Finalize (faults.leave)."""
    from . import faults

    MPI = _state["MPI"]
    if MPI is None:
        return
    faults.write_report(settings.rc.elastic_report, MPI.COMM_WORLD.Get_rank(), _state["reforms"])
    if _state["generation"]:
        faults.leave()


def generation() -> int:
    """How many times an elastic job re-formed its world (0: never)."""
    return _state["generation"]


def reforms() -> list:
    """What each re-forming did: dicts of ``old_size``, ``new_size``, ``lost`` (old world
    ranks), ``rank`` (this rank's new rank) and ``seconds`` (the shrink and rebuild)."""
    return list(_state["reforms"])


def on_reform(hook: Callable[[], None]) -> None:
    """Call ``hook()`` after each re-forming of the world (e.g. an optimizer that rebuilds
    its buckets on the new world). Bound methods are held weakly."""
    ref = weakref.WeakMethod(hook) if hasattr(hook, "__self__") else (lambda: hook)
    _state["reform_hooks"].append(ref)


def reform(min_ranks: int = 1) -> "Group":
    """Re-form the world from the ranks still alive, after a RanksLostError (elastic jobs;
    every survivor must call it). Revokes every group's communicators, waits for queued async
    collectives (they fail at once on revoked communicators), shrinks the world communicator
    (MPI_Comm_shrink) and builds a new world group on it: new ranks 0..n-1 in the old order,
    new node and cross-node communicators, shared windows and flag slots. Process sets and
    groups made before are gone. A rank lost meanwhile makes the survivors start over (the
    shrink leaves out every failed process MPI knows of). Raises ElasticError on every
    survivor when fewer than ``min_ranks`` are left. The stall watchdog bounds the shrink."""
    import gc
    import time

    from . import asyncq, faults

    old = world()
    if not hasattr(old.comm, "Shrink"):
        raise ElasticError("comm.reform needs an MPI with the ULFM extension.\n" + faults.HOW_TO_ENABLE)
    start = time.monotonic()
    while True:
        _abandon_all()
        asyncq.drain()  # queued async collectives fail at once on the revoked communicators: none runs later
        try:
            group, lost = _shrink_world(old, min_ranks)
            break
        except RanksLostError:
            continue
    _state["generation"] += 1
    _state["reforms"].append(dict(old_size=old.size, new_size=group.size, lost=lost,
                                  lost_launched=[_state["launched"][r] for r in lost], rank=group.rank,
                                  seconds=time.monotonic() - start, time=time.time()))
    _state["launched"] = [m for r, m in enumerate(_state["launched"]) if r not in lost]
    # Every survivor runs the same hooks (some are collective): objects no rank holds any more
    # are collected first, on every rank alike, rather than whenever each rank's GC runs.
    gc.collect()
    for ref in list(_state["reform_hooks"]):
        hook = ref()
        if hook is None:
            _state["reform_hooks"].remove(ref)
        else:
            hook()
    return group


def _shrink_world(old: "Group", min_ranks: int):
    """The survivors' communicator and world group; (group, the old ranks lost). The module's
    state changes only when the group is built (a failure meanwhile leaves it as it was)."""
    dog = watchdog()
    with dog.watch(f"re-forming the world after a lost rank (MPI_Comm_shrink of {old.size} ranks)",
                   lambda: "some surviving rank (every survivor must call reform)"):
        new = _state["base"].Shrink()
        survivors = new.allgather(old.rank)
    lost = sorted(set(range(old.size)) - set(survivors))
    if new.Get_size() < min_ranks:
        raise ElasticError(f"{len(lost)} rank(s) lost (old ranks {', '.join(map(str, lost))}): {new.Get_size()} "
                           f"left, fewer than min_ranks={min_ranks}; ending the job.\nHINT: lower the minimum "
                           "(HPCTRAIN_ELASTIC_MIN_RANKS, `hpctrain launch --elastic --min-np`) or resume from the "
                           "last checkpoint with more ranks")
    previous_base, _state["base"] = _state["base"], new  # Group() reads its members' ranks from the base
    try:
        with _creating("the world group on the survivors", "every survivor must call reform"):
            group = Group(new, "world")
    except RanksLostError:
        _state["base"] = previous_base
        raise
    _state["world"] = group
    dog.rank = group.rank
    return group, lost


def is_initialized() -> bool:
    return _state["world"] is not None


def shutdown() -> None:
    """Wait for pending async work, free hpctrain's communicators. MPI itself is finalized by
    mpi4py at exit (so that mpi4py users can keep using MPI after hpctrain is done)."""
    if _state["world"] is None:
        return
    drain()
    _announce_end()
    _state["notices"] = None
    if _state["watchdog"] is not None:
        _state["watchdog"].stop()
    _state["world"].free()
    _state["world"] = None


def world() -> Group:
    group = _state["world"]
    if group is None:
        raise NotInitializedError(
            "hpctrain.comm is not initialized. HINT: call hpctrain.comm.init() (or hvd.init()) first."
        )
    return group


def watchdog() -> Watchdog:
    world()
    return _state["watchdog"]


def resolve(group: Optional[Group]) -> Group:
    g = world() if group is None else group
    if not isinstance(g, Group):
        raise TypeError(f"group must be an hpctrain.comm.Group or None, got {type(g).__name__}")
    return g


def rank() -> int:
    return world().rank


def size() -> int:
    return world().size


def local_rank() -> int:
    return world().local_rank


def local_size() -> int:
    return world().local_size


def cross_rank() -> int:
    return world().cross_rank


def cross_size() -> int:
    return world().cross_size


def hostname() -> str:
    return socket.gethostname()


def mpi_library_version() -> str:
    """The MPI library's own version string (first line), e.g. 'Open MPI v5.0.11, …'."""
    import mpi4py

    from mpi4py import MPI  # noqa: F811 - the one place other packages get MPI facts from

    return MPI.Get_library_version().strip().splitlines()[0] + f" (mpi4py {mpi4py.__version__})"


def mpi_threads_supported() -> bool:
    return _mpi().Query_thread() == _mpi().THREAD_MULTIPLE


# --------------------------------------------------------------------------- groups
def new_group(ranks: Sequence[int]) -> Optional[Group]:
    """A group of the given world ranks (in that order). Every world rank must call this;
    ranks outside the group get None."""
    w = world()
    ranks = list(ranks)
    if not ranks:
        raise ValueError("new_group needs at least one rank")
    bad = [r for r in ranks if not 0 <= r < w.size]
    if bad or len(set(ranks)) != len(ranks):
        raise ValueError(f"new_group: ranks must be distinct world ranks in [0, {w.size}); got {ranks}")
    MPI = _mpi()
    with _creating(f"new_group({ranks})", "every world rank must call new_group, in the same order"):
        mpi_group = w.comm.Get_group().Incl(ranks)
        sub = w.comm.Create(mpi_group)  # collective over the world
        mpi_group.Free()
        if sub == MPI.COMM_NULL:
            return None
        return Group(sub, f"group{ranks}")


def _creating(what: str, rule: str):
    """A group's creation is a chain of collectives (communicators, the node's shared window,
    agreements): under the stall watchdog like any collective, so that a rank that never
    calls it aborts the job with a report instead of hanging it."""
    return watchdog().watch(what, lambda: f"some rank ({rule})")


def split(color: int, key: Optional[int] = None, group: Optional[Group] = None) -> Group:
    """Split a group by colour (like MPI_Comm_split): ranks with the same colour form a group,
    ordered by ``key`` (default: their rank). Every rank of ``group`` must call this."""
    g = resolve(group)
    if color < 0:
        raise ValueError(f"split: colour must be ≥ 0, got {color}")
    with _creating(f"split(color={color}) of {g.name}", f"every rank of {g.name} must call split, in the same order"):
        sub = g.comm.Split(color=color, key=g.rank if key is None else key)
        return Group(sub, f"{g.name}/color{color}")


# --------------------------------------------------------------------------- aborting
# MPI_Abort normally ends every rank within a second; under fault tolerance (an elastic job
# after a lost rank) Open MPI 5's launcher was seen to take the abort and then neither kill
# the ranks nor exit. Past this deadline the aborting rank ends itself.
ABORT_DEADLINE_S = 30.0


def abort_job(code: int = 1) -> None:
    """End the whole MPI job (MPI_Abort on the world); this rank exits with ``code`` at the
    latest, or with status 1 after ABORT_DEADLINE_S when MPI_Abort does not return or end it
    (a thread in C that needs no GIL: faulthandler's, which first prints every thread's stack)."""
    import faulthandler

    MPI = _state["MPI"]
    if MPI is not None:
        try:
            sys.stderr.flush()
            faulthandler.dump_traceback_later(ABORT_DEADLINE_S, exit=True)
        except (AttributeError, OSError, RuntimeError, ValueError):  # no usable stderr: abort without the deadline
            pass
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def _install_excepthook() -> None:
    """An uncaught exception on any rank aborts the whole job (instead of the other ranks
    hanging in their next collective). Set HPCTRAIN_ABORT_ON_EXCEPTION=0 to keep Python's hook."""
    if not settings.rc.abort_on_exception:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt) or _state["world"] is None:
            previous(exc_type, exc, tb)
            return
        report_and_abort(exc_type, exc, tb)

    sys.excepthook = hook


def report_and_abort(exc_type, exc, tb) -> None:
    rank_ = _state["world"].rank if _state["world"] is not None else "?"
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(
        f"hpctrain: rank {rank_} raised an unhandled exception; aborting the whole job so the "
        f"other ranks do not hang.\n{text}"
    )
    sys.stderr.flush()
    MPI = _state["MPI"]
    if MPI is not None and settings.rc.elastic_report:
        # An elastic job's launcher must not take this rank for finished (under fault
        # tolerance mpiexec itself has exited 0 after an MPI_Abort): it reads this report.
        from . import faults

        faults.write_report(settings.rc.elastic_report, MPI.COMM_WORLD.Get_rank(), _state["reforms"],
                            finished=False, code=1)
    abort_job(1)


def rendezvous_store(host: Optional[str] = None, timeout_s: float = 300.0, group: Optional[Group] = None):
    """A ``torch.distributed.TCPStore`` shared by the ranks of ``group``, for
    ``init_process_group(store=...)`` (no MASTER_ADDR/PORT boilerplate). Collective.

    Rank 0 starts the store's server on a port the operating system picks (port 0) and keeps
    it bound, so that no other process can take the port between choosing and listening;
    its address (``host``, default rank 0's host address, and the store's port) reaches every
    rank over MPI, and the other ranks connect to it. torch is imported here only."""
    import datetime

    from torch.distributed import TCPStore

    g = resolve(group)
    drain()  # queued async collectives first: the same order on every rank
    timeout = datetime.timedelta(seconds=timeout_s)
    store, address, error = None, None, None
    if g.rank == 0:
        try:
            # the server listens on every interface; `host` is where the others reach it
            host = host or _host_address()
            store = TCPStore(host, 0, g.size, is_master=True, timeout=timeout, wait_for_workers=False)
            address = (host, store.port)
        except (RuntimeError, OSError) as exc:
            error = f"rank 0 could not start the rendezvous store for torch.distributed: {exc}"
    dog = watchdog()
    agree(g, make_header(0, "broadcast_object", extra=1), dog)
    with dog.watch(f"rendezvous address from rank 0 of {g.name}", lambda: g.describe_ranks([0])):
        address, error = g.comm.bcast((address, error), root=0)
    if error is not None:
        raise CommError(error + "\nHINT: check that rank 0 may listen on a TCP port (firewall, ulimit -n)")
    if store is None:
        try:
            store = TCPStore(address[0], address[1], g.size, is_master=False, timeout=timeout)
        except (RuntimeError, OSError) as exc:
            raise CommError(f"rank {g.rank} could not reach the rendezvous store at {address[0]}:{address[1]} "
                            f"(rank 0's): {exc}\nHINT: set HPCTRAIN_RENDEZVOUS_ADDR to an address of rank 0's "
                            "node that this node can reach") from exc
    return store


def _host_address() -> str:
    host = hostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


def world_ranks_of(mpi_comm: Any) -> List[int]:
    """The world ranks of an mpi4py communicator's members, in its rank order (every member
    of ``mpi_comm`` must be a rank of the world; local, no communication)."""
    members = list(range(mpi_comm.Get_size()))
    theirs, ours = mpi_comm.Get_group(), world().comm.Get_group()
    try:
        ranks = [int(r) for r in theirs.Translate_ranks(members, ours)]
    finally:
        theirs.Free()
        ours.Free()
    if any(r < 0 for r in ranks):
        raise ValueError(f"the communicator holds processes outside hpctrain's world (world ranks {ranks}).\n"
                         "HINT: build it from MPI.COMM_WORLD (e.g. MPI.COMM_WORLD.Split(...))")
    return ranks
