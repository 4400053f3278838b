"""Horovod's process sets on hpctrain's groups: ``hvd.ProcessSet``, ``init(process_sets=...)``,
``add_process_set``, ``remove_process_set`` (``horovod.common.process_sets``).

A registered set has an id, the same on every rank: 0 is the world (``global_process_set``),
the others are numbered in registration order, and an id freed by ``remove_process_set`` is
handed out again first (Horovod's process set table does the same). A ``ProcessSet`` object
only points at an id; several objects may point at one: ``init(process_sets=...)`` attaches
a set whose ranks are registered already to the existing id, as Horovod does.

Registering is collective (every rank builds the set's communicator), so the ranks first
compare what they were given: different sets on different ranks are a ValueError on every
rank, not a hang in the communicator's creation. A set given as an mpi4py communicator
(``ProcessSet(subcomm)``, with ``init``) may differ between ranks (each rank passes its own
part of a split): the ranks register the union of them, the communicators' sets first, in
the order of the ranks that passed them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

from hpctrain import comm

from .exceptions import require_init

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


@dataclass
class _Entry:
    ranks: List[int]
    group: Any  # the hpctrain group; None on ranks outside the set, and for the world


_table: Dict[int, _Entry] = {}
_free_ids: List[int] = []  # removed ids, reused oldest first
_next_id = 1


def _is_communicator(obj: Any) -> bool:
    return hasattr(obj, "Get_group") and hasattr(obj, "Get_size")


class ProcessSet:
    """A subset of ranks that runs collectives together (Horovod's ``hvd.ProcessSet``).

    ``ProcessSet([0, 2])`` (any iterable of world ranks; their order does not matter) or
    ``ProcessSet(mpi4py_communicator)`` describes the ranks; ``hvd.init(process_sets=[...])``
    or ``hvd.add_process_set`` (every rank) registers it and sets ``process_set_id``.
    ``global_process_set`` is every rank (id 0).
    """

    def __init__(self, ranks_or_comm: Union[Sequence[int], Any]) -> None:
        self.process_set_id: Optional[int] = None
        self.ranks: Optional[List[int]] = None
        self.mpi_comm: Any = None
        self._global = False
        if _is_communicator(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            self.ranks = sorted(int(r) for r in ranks_or_comm)
        except (TypeError, ValueError):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm "
                             f"object, got {ranks_or_comm!r}.\nHINT: hvd.ProcessSet([0, 1]) or "
                             "hvd.ProcessSet(MPI.COMM_WORLD.Split(...))") from None

    def _entry(self) -> Optional[_Entry]:
        """This set's table entry, if it is registered (an object whose id was removed, or
        handed to other ranks since, is not)."""
        entry = _table.get(self.process_set_id) if self.process_set_id is not None else None
        return entry if entry is not None and entry.ranks == self.ranks else None

    @property
    def _registered(self) -> bool:
        return self._global or self._entry() is not None

    def _resolve(self) -> Any:
        """The set's hpctrain group (None: the world); a clear error where it cannot run."""
        if self._global:
            return None
        entry = self._entry()
        if entry is None:
            raise ValueError(f"{self} is not registered.\n"
                             "HINT: register it on every rank first: hvd.add_process_set(process_set), or "
                             "hvd.init(process_sets=[...])")
        if entry.group is None:
            raise ValueError(f"this rank ({comm.rank()}) is not in process set {self.ranks}; "
                             "only its members may run collectives on it")
        return entry.group

    def included(self) -> Optional[bool]:
        """Whether this rank belongs to the set (None for a communicator's set not registered yet)."""
        if self._global:
            return True
        return None if self.ranks is None else comm.rank() in self.ranks

    def rank(self) -> int:
        """This rank's position in the set."""
        return comm.rank() if self._global else self._resolve().rank

    def size(self) -> Optional[int]:
        """Number of ranks in the set (None for a communicator's set not registered yet)."""
        if self._global:
            return comm.size()
        return None if self.ranks is None else len(self.ranks)

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])  # its ranks are the world's from init() on
global_process_set._global = True
global_process_set.process_set_id = 0


def start(mpi_comm: Any = None) -> None:
    """At ``init()``: the world is set 0 (once per world: a second ``init()`` keeps the sets)."""
    world = list(range(comm.size()))
    if _table.get(0) is None or _table[0].ranks != world:
        _reset(world)
    if mpi_comm is not None and _is_communicator(mpi_comm):
        global_process_set.mpi_comm = mpi_comm


def _reset(world: List[int]) -> None:
    """Only the world registered, ids from 1 again (a new world, or after shutdown)."""
    global _next_id
    _table.clear()
    _table[0] = _Entry(list(world), None)
    _free_ids.clear()
    _next_id = 1
    global_process_set.ranks = list(world)


def shutdown() -> None:
    """Every set unregistered (``global_process_set`` keeps its ranks, as in Horovod)."""
    global _next_id
    _table.clear()
    _free_ids.clear()
    _next_id = 1


def _forget_on_reform() -> None:
    """After an elastic job re-formed its world, the sets made before name ranks of a world
    that is gone: they are removed (register them again on the new world)."""
    _reset(list(range(comm.size())))


comm.on_reform(_forget_on_reform)


def _lookup(ranks: List[int]) -> Optional[int]:
    return next((ps_id for ps_id, entry in _table.items() if entry.ranks == ranks), None)


def _register(ranks: List[int]) -> int:
    """Build the set's group (collective: every rank, same order) and give it an id."""
    global _next_id
    group = comm.new_group(ranks)
    if _free_ids:
        ps_id = _free_ids.pop(0)
    else:
        ps_id, _next_id = _next_id, _next_id + 1
    _table[ps_id] = _Entry(list(ranks), group)
    return ps_id


def _check_ranks(ranks: List[int]) -> None:
    bad = [r for r in ranks if not 0 <= r < comm.size()]
    if bad:
        raise ValueError(f"process set ranks {bad} outside 0..{comm.size() - 1}.\n"
                         "HINT: a process set names world ranks, 0 .. hvd.size() - 1")
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"a process set needs distinct ranks, at least one; got {ranks}.\n"
                         "HINT: e.g. hvd.ProcessSet([0, 1])")


def _agree(what: str, sets: List[List[int]], extra: Any = None, error: Optional[Exception] = None) -> List[Any]:
    """Every rank's ``extra``, once the ranks have compared their ``sets``: a ValueError on
    every rank where they differ. ``error``: this rank could not build its sets; it still
    joins the comparison (no rank is left waiting), raises ``error``, and the others a
    ValueError naming it."""
    every = comm.allgather_object((sets, extra, None if error is None else f"{type(error).__name__}: {error}"))
    if error is not None:
        raise error
    failed = next((r for r, (_, _, text) in enumerate(every) if text is not None), None)
    if failed is not None:
        raise ValueError(f"{what}: rank {failed} could not use its process sets ({every[failed][2]}).\n"
                         "HINT: every rank must pass the same, valid process sets; see that rank's error")
    odd = next((r for r, (theirs, _, _) in enumerate(every) if theirs != every[0][0]), None)
    if odd is not None:
        raise ValueError(f"{what}: attempted to register process sets with mismatching values on different "
                         f"ranks: rank 0 passed {every[0][0]}, rank {odd} passed {every[odd][0]}.\n"
                         "HINT: every rank must register the same process sets, in the same order")
    return [theirs for _, theirs, _ in every]


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set after ``init()`` and return it; every rank must call it, with
    the same ranks, in the same order. Refuses ranks registered already (ValueError)."""
    require_init("add_process_set")
    ps: Optional[ProcessSet] = None
    error: Optional[Exception] = None
    try:
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        if ps.ranks is None:
            raise NotImplementedError("add_process_set: a process set defined by an MPI communicator can be "
                                      "registered only by hvd.init(process_sets=[...]).\n"
                                      "HINT: build the process set from a list of ranks")
    except (ValueError, NotImplementedError) as err:
        error = err
    _agree("add_process_set", [ps.ranks] if error is None else [], error=error)
    _check_ranks(ps.ranks)
    if ps._global or _lookup(ps.ranks) is not None:
        raise ValueError(f"Attempted to add a duplicate process set: {ps}.\n"
                         "HINT: reuse the ProcessSet registered earlier for these ranks")
    ps.process_set_id = _register(ps.ranks)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (every rank must call it). Returns True when it was registered;
    the global set is never removed."""
    if process_set._global or process_set._entry() is None:
        return False
    ps_id = process_set.process_set_id
    del _table[ps_id]
    _free_ids.append(ps_id)
    process_set.process_set_id = None
    return True


def register_at_init(process_sets: Union[Sequence[ProcessSet], str, None]) -> None:
    """``init(process_sets=...)``: register what is new (collective), then point every object
    at its id. An entry whose ranks another entry (or the world) already has is a duplicate:
    ValueError on the ranks where it is one, after the others are registered (Horovod)."""
    if process_sets is None:
        return
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"init(process_sets={process_sets!r}): not a list of process sets.\n"
                             "HINT: pass a list of hvd.ProcessSet, or 'dynamic'")
        return  # every hpctrain job can add process sets after init
    sets = list(process_sets)
    via_comm: List[bool] = []
    wanted: List[List[int]] = []
    error: Optional[Exception] = None
    try:
        bad = [ps for ps in sets if not isinstance(ps, ProcessSet)]
        if bad:
            raise TypeError(f"init(process_sets=...): expected hvd.ProcessSet objects, got {bad[0]!r}.\n"
                            "HINT: hvd.ProcessSet([0, 1]) or hvd.ProcessSet(mpi4py_communicator)")
        via_comm = [ps.mpi_comm is not None and not ps._global for ps in sets]
        wanted = [comm.world_ranks_of(ps.mpi_comm) if c else ps.ranks for ps, c in zip(sets, via_comm)]
    except (TypeError, ValueError) as err:
        error = err
    by_ranks = [ranks for ps, ranks, c in zip(sets, wanted, via_comm) if not (c or ps._global)]
    by_comm = _agree("init(process_sets=...)", by_ranks, [ranks for ranks, c in zip(wanted, via_comm) if c],
                     error=error)
    for ranks in wanted:
        _check_ranks(ranks)
    for ranks in _registration_order(by_comm, by_ranks):
        if _lookup(ranks) is None:
            _register(ranks)
    _attach(sets, wanted)


def _registration_order(by_comm: List[List[List[int]]], by_ranks: List[List[int]]) -> List[List[int]]:
    """Each set once, the communicators' first (rank 0's, rank 1's …), then the listed ranks."""
    order: List[List[int]] = []
    for ranks in [r for theirs in by_comm for r in theirs] + by_ranks:
        if ranks not in order:
            order.append(ranks)
    return order


def _attach(sets: List[ProcessSet], wanted: List[List[int]]) -> None:
    seen = {0}
    duplicate = None
    for i, (ps, ranks) in enumerate(zip(sets, wanted)):
        ps_id = 0 if ps._global else _lookup(ranks)
        if ps_id in seen:
            if not ps._global:
                ps.process_set_id = None
            duplicate = i if duplicate is None else duplicate
            continue
        seen.add(ps_id)
        ps.process_set_id, ps.ranks = ps_id, list(ranks)
    if duplicate is not None:
        raise ValueError(f"hpctrain could not be initialized because process_sets entry number {duplicate} is a "
                         f"duplicate: {sets[duplicate]}.\nHINT: name each set of ranks once; the global process "
                         "set (every rank) is always registered")


def ids_and_ranks() -> Dict[int, List[int]]:
    """``{process_set_id: ranks}`` of every registered set (Horovod's internal
    ``_basics._get_process_set_ids_and_ranks()``)."""
    require_init("process sets")
    return {ps_id: list(entry.ranks) for ps_id, entry in sorted(_table.items())}


def comm_process_set_id(mpi_comm: Any) -> int:
    """The id of the registered set whose ranks are ``mpi_comm``'s."""
    require_init("process sets")
    ps_id = _lookup(comm.world_ranks_of(mpi_comm))
    if ps_id is None:
        raise ValueError("MPI communicator does not correspond to any registered process set.\n"
                         "HINT: register it first: hvd.init(process_sets=[hvd.ProcessSet(comm)])")
    return ps_id


def group_of(process_set: Optional[ProcessSet]) -> Any:
    return (process_set or global_process_set)._resolve()


def size_of(process_set: Optional[ProcessSet]) -> int:
    return (process_set or global_process_set).size()
