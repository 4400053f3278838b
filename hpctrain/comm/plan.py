"""Pure planning for collectives: ring chunks and peers, topology, algorithm choice and the
all-reduce route.

Nothing here talks to MPI; every function takes rank and size as arguments so that one
process can build every rank's view in a unit test.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

# One size rule for all of hpctrain (every unit a power of 1024); re-exported as comm.parse_size.
from ..settings import format_size, parse_size  # noqa: F401

Bounds = Tuple[int, int]


def chunk_bounds(length: int, parts: int) -> List[Bounds]:
    """Split ``range(length)`` into ``parts`` contiguous chunks whose sizes differ by ≤ 1.

    The first ``length % parts`` chunks get one extra element (Horovod's ``split_list``).
    Chunks may be empty when ``length < parts``.
    """
    if parts < 1:
        raise ValueError(f"parts must be ≥ 1, got {parts}")
    if length < 0:
        raise ValueError(f"length must be ≥ 0, got {length}")
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def alltoall_splits(rows: int, size: int, splits=None):
    """The rows an alltoall sends to each of ``size`` ranks, as int64: ``splits`` checked, or an
    even split of ``rows``."""
    import numpy as np

    if splits is None:
        if rows % size:
            raise ValueError(
                f"alltoall: {rows} rows cannot be split evenly over {size} ranks. HINT: pass splits=[…]"
            )
        splits = [rows // size] * size
    counts = np.asarray(list(splits), dtype=np.int64)
    if counts.size != size or (counts < 0).any() or int(counts.sum()) != rows:
        raise ValueError(
            f"alltoall: splits must be {size} non-negative row counts summing to {rows}, got {counts.tolist()}"
        )
    return counts


def split_counts(length: int, parts: int) -> List[int]:
    return [b - a for a, b in chunk_bounds(length, parts)]


def ring_neighbors(rank: int, size: int) -> Tuple[int, int]:
    """(left, right): receive from left, send to right."""
    _check_rank(rank, size)
    return (rank - 1) % size, (rank + 1) % size


def reduce_scatter_step(rank: int, size: int, step: int) -> Tuple[int, int]:
    """Chunk ids (send, receive) at ``step`` of the ring reduce-scatter (0 ≤ step < size−1).

    After the last step, ``rank`` holds the fully reduced chunk ``owned_chunk(rank, size)``.
    """
    _check_rank(rank, size)
    return (rank - step) % size, (rank - step - 1) % size


def owned_chunk(rank: int, size: int) -> int:
    """The chunk a rank holds fully reduced after the ring reduce-scatter."""
    return (rank + 1) % size


def allgather_step(rank: int, size: int, step: int) -> Tuple[int, int]:
    """Chunk ids (send, receive) at ``step`` of the ring all-gather (0 ≤ step < size−1)."""
    _check_rank(rank, size)
    return (rank + 1 - step) % size, (rank - step) % size


@dataclass(frozen=True)
class RingStep:
    """One step of the ring on one rank: send ``send``, receive ``recv`` (element bounds);
    ``single``: both fit one segment (one Sendrecv instead of pipelined segments)."""

    send: Bounds
    recv: Bounds
    single: bool


@dataclass(frozen=True)
class RingSchedule:
    """Everything one rank's ring all-reduce of ``length`` elements does, computed once."""

    left: int
    right: int
    reduce_scatter: Tuple[RingStep, ...]
    allgather: Tuple[RingStep, ...]
    owned: Bounds
    max_chunk: int


@lru_cache(maxsize=512)
def ring_schedule(length: int, size: int, rank: int, seg_elems: int) -> RingSchedule:
    """The ring all-reduce of ``length`` elements on ``rank`` of ``size``, with segments of at
    most ``seg_elems`` elements (cached: a training loop all-reduces the same sizes every
    step, and building this costs more than a small message's transfer)."""
    bounds = chunk_bounds(length, size)
    left, right = ring_neighbors(rank, size)

    def step(send_chunk: int, recv_chunk: int) -> RingStep:
        send, recv = bounds[send_chunk], bounds[recv_chunk]
        return RingStep(send, recv, send[1] - send[0] <= seg_elems and recv[1] - recv[0] <= seg_elems)

    return RingSchedule(
        left, right,
        tuple(step(*reduce_scatter_step(rank, size, k)) for k in range(size - 1)),
        tuple(step(*allgather_step(rank, size, k)) for k in range(size - 1)),
        bounds[owned_chunk(rank, size)],
        max(b - a for a, b in bounds),
    )


def segments(start: int, stop: int, seg_elems: int) -> List[Bounds]:
    """Split ``[start, stop)`` into pipelining segments of at most ``seg_elems`` elements."""
    if seg_elems < 1:
        raise ValueError(f"segment size must be ≥ 1 element, got {seg_elems}")
    return [(a, min(a + seg_elems, stop)) for a in range(start, stop, seg_elems)]


def _check_rank(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a world of size {size}")


# --------------------------------------------------------------------------- topology
@dataclass(frozen=True)
class Topology:
    """Where each rank of a group lives. ``node_of[r]`` is the node index of group rank r.

    Nodes are numbered in order of their lowest rank, so node 0 holds rank 0.
    """

    node_of: Tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.node_of:
            raise ValueError("a topology needs at least one rank")

    @property
    def size(self) -> int:
        return len(self.node_of)

    @cached_property
    def num_nodes(self) -> int:
        return max(self.node_of) + 1

    def ranks_on(self, node: int) -> List[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def local_rank(self, rank: int) -> int:
        return self.ranks_on(self.node_of[rank]).index(rank)

    def local_size(self, rank: int) -> int:
        return len(self.ranks_on(self.node_of[rank]))

    def cross_rank(self, rank: int) -> int:
        return self.node_of[rank]

    @property
    def cross_size(self) -> int:
        return self.num_nodes

    @cached_property
    def homogeneous(self) -> bool:
        """Every node has the same number of ranks (needed by the hierarchical path)."""
        counts = [len(self.ranks_on(n)) for n in range(self.num_nodes)]
        return len(set(counts)) == 1

    @cached_property
    def single_node(self) -> bool:
        return self.num_nodes == 1


class CheckSchedule(NamedTuple):
    """One rank's messages in the agreement check over MPI (``guard``).

    Recursive doubling over the largest power of two of the *core* ranks; every other rank
    hands its part to a *home* rank first and gets the result back from it at the end. On one
    node (or with one rank per node) every rank is a candidate for the core; with several
    nodes holding several ranks, only each node's leader (its lowest rank) is: the node's
    ranks fold into it along a binomial tree over the node's own transport, and only the
    leaders' messages cross the network: one per step per node, where every rank's part
    crossing in the same steps put ``local_size`` times the messages on the network and on the
    CPUs that move them.

    ``home``: the rank this one sends its part to and gets the result from, else -1;
    ``extras``: the ranks whose parts this one takes first (in this order) and then sends the
    result to (its children in the node's tree; a leader, then a leader folded into it);
    ``partners``: a core rank's partner at each step (none for a rank with a home); ``steps``:
    the core's number of steps. The stages a rank waits in (what a stall report names): 0 an
    extra's part, k + 1 step k, steps + 1 the result from home. For stall reports (the rank
    waiting where the check really stopped reports first): ``extra_heights``, the levels of
    parts each extra itself waits for before it sends (0: none), and ``levels``, more than any
    rank's (0 without trees: the stages alone order the waits). The C check
    (``_mpiring.check``) runs the same schedule, passed as ``encoded()``."""

    home: int
    extras: Tuple[int, ...]
    partners: Tuple[int, ...]
    steps: int
    extra_heights: Tuple[int, ...] = ()
    levels: int = 0

    def encoded(self) -> bytes:
        """int32 [home, number of extras, extras..., number of partners, partners...]."""
        words = [self.home, len(self.extras), *self.extras, len(self.partners), *self.partners]
        return struct.pack(f"={len(words)}i", *words)


def check_schedule(rank: int, size: int, node_of: Optional[Sequence[int]] = None) -> CheckSchedule:
    """Where ``rank`` of ``size`` (>= 2) sends and receives its part of the agreement check;
    ``node_of``: each rank's node (none: flat recursive doubling over every rank)."""
    leaders = _check_leaders(size, node_of)
    if leaders is None:
        return _doubling(rank, list(range(size)), ())
    on_node = [r for r in range(size) if node_of[r] == node_of[rank]]
    local, count = on_node.index(rank), len(leaders)
    depth = {node: 0 for node in leaders}  # each node's tree depth: the levels its leader waits for
    for node in node_of:
        depth[node] += 1
    depth = {node: (ranks - 1).bit_length() for node, ranks in depth.items()}
    levels = max(depth.values()) + 1
    # a binomial tree on the node: local index i takes the parts of i + 2^k for every 2^k below
    # i's lowest set bit (in rising k: the smaller subtrees complete first) and hands the sum to
    # i without that bit; log2(ranks on the node) levels, where one leader taking every part in
    # turn would wait for each
    low = local & -local if local else 1 << len(on_node).bit_length()
    spans = [(k, min(1 << k, len(on_node) - local - (1 << k))) for k in range(low.bit_length() - 1)
             if local + (1 << k) < len(on_node)]
    children = tuple(on_node[local + (1 << k)] for k, _ in spans)
    heights = tuple((span - 1).bit_length() for _, span in spans)
    if local:
        return CheckSchedule(on_node[local - low], children, (), _core(count)[1], heights, levels)
    schedule = _doubling(rank, sorted(leaders.values()), children)
    folded = {leader: depth[node] for node, leader in leaders.items()}  # a leader folded into this one
    return schedule._replace(extra_heights=heights + tuple(folded[e] for e in schedule.extras[len(children):]),
                             levels=levels)


def _core(count: int) -> Tuple[int, int]:
    """The largest power of two of ``count`` ranks (the recursive doubling's core) and its steps."""
    core = 1 << (count.bit_length() - 1)
    return core, core.bit_length() - 1


def _check_leaders(size: int, node_of: Optional[Sequence[int]]) -> Optional[Dict[int, int]]:
    """Node -> its lowest rank, where the check folds each node into its leader: several
    nodes, one of them with several ranks; else None."""
    if node_of is None:
        return None
    if len(node_of) != size:
        raise ValueError(f"node_of has {len(node_of)} entries for {size} ranks")
    leaders: Dict[int, int] = {}
    for r, node in enumerate(node_of):
        leaders.setdefault(node, r)
    return leaders if 1 < len(leaders) < size else None


def _doubling(rank: int, core_candidates: List[int], local: Tuple[int, ...]) -> CheckSchedule:
    """Recursive doubling over the largest power of two of ``core_candidates`` (ascending), the
    others folded into core rank index - power; ``local``: ranks folded into ``rank`` before."""
    count = len(core_candidates)
    core, steps = _core(count)
    index = core_candidates.index(rank)
    if index >= core:
        return CheckSchedule(core_candidates[index - core], local, (), steps)
    extra = (core_candidates[index + core],) if index + core < count else ()
    partners = tuple(core_candidates[index ^ (1 << k)] for k in range(steps))
    return CheckSchedule(-1, local + extra, partners, steps, (0,) * len(local + extra))


def check_transfers(size: int, node_of: Optional[Sequence[int]] = None) -> int:
    """The most parts any rank of the group receives in one check (its extras' and its
    partners'): what bounds the data that rides on it (``guard.inband_limit``); the same on
    every rank. Counted, not scheduled rank by rank: O(size)."""
    if size < 2:
        return 0
    leaders = _check_leaders(size, node_of)
    count = size if leaders is None else len(leaders)
    core, steps = _core(count)
    if leaders is None:
        return steps + (1 if count > core else 0)
    local = [0] * (max(node_of) + 1)
    for node in node_of:
        local[node] += 1
    order = sorted(leaders, key=leaders.__getitem__)  # nodes by their leader's rank: core index
    # a leader takes the most parts of its node's tree: one per level
    return max((local[node] - 1).bit_length() + ((steps + (1 if i + core < count else 0)) if i < core else 0)
               for i, node in enumerate(order))


def topology_from_keys(node_keys: Sequence[object]) -> Topology:
    """Build a topology from any per-rank node identifier (hostname, leader rank…)."""
    index: Dict[object, int] = {}
    node_of = []
    for key in node_keys:
        if key not in index:
            index[key] = len(index)
        node_of.append(index[key])
    return Topology(tuple(node_of))


# --------------------------------------------------------------------------- algorithm choice
ALGORITHMS = ("auto", "ring", "native", "shm", "hierarchical")

# Thresholds from `hpctrain bench allreduce` on a 2-core node (Open MPI 5.0.11, 2–4 ranks,
# float32; tables in docs/performance.md). On the caller's own (private) buffer, one node:
# with the shared-memory flags, the flag exchange up to 256 KiB (shmsync.SMALL_ALLREDUCE_BYTES)
# and the piped path above it (below); without them MPI_Allreduce in place wins up to tens of
# MiB (a Python ring pays ~17 µs per message and a whole-buffer window copy costs a pass in
# and out). From LARGE_RING_BYTES the ring, since Open MPI's large-message algorithm
# degrades. Data already in a shared buffer (zero-copy) beats native from SHARED_SMALL_BYTES.
# Across nodes (2 namespace "nodes" x 2 ranks on 2 cores, TCP over veth, docs/performance.md)
# MPI_Allreduce leads below CROSS_NODE_RING_BYTES; the ring ties it there and leads from 1 MiB
# (1.5-2.6x); the hierarchical path (1/local_size of the data crosses the network, but
# node-wide synchronisations on every call: 1.0-1.1x MPI at 256 KiB, 1.1-1.4x at 1 MiB from run
# to run) from CROSS_NODE_HIERARCHICAL_BYTES, where it leads (1.8-2.8x; with the data already in
# a shared buffer, zero-copy, the gradient buckets: 2.3-3.6x); both thresholds are
# settings (HPCTRAIN_CROSS_NODE_RING_BYTES, HPCTRAIN_CROSS_NODE_HIERARCHICAL_BYTES): re-measure
# them on a real interconnect with `hpctrain bench allreduce` across two nodes.
LARGE_RING_BYTES = 32 * 1024 * 1024
# With the node's shared-memory flags, a private buffer larger than the flag exchange and
# smaller than LARGE_RING_BYTES streams through the flag slots in cache-sized segments ("shm",
# piped): the buffer read and written once. Which of it and MPI_Allreduce wins depends on
# where the host places the vCPUs (on the 2-core machine these thresholds were tuned on, the
# same 16 MiB piped call ran faster than MPI in one placement and several times slower in the
# other; docs/performance.md). So these fixed choices are only the fall-back
# (HPCTRAIN_AUTOTUNE=0) and the first candidate tried: by default auto measures on one node
# (tuning_candidates, hpctrain.comm.tuning).
CROSS_NODE_RING_BYTES = 256 * 1024
CROSS_NODE_HIERARCHICAL_BYTES = 4 * 1024 * 1024
CROSS_NODE = (CROSS_NODE_RING_BYTES, CROSS_NODE_HIERARCHICAL_BYTES)
SHARED_SMALL_BYTES = 16 * 1024
# From 1 MiB at 3 or more ranks the ring (in C) is a third candidate of the run-time choice:
# there it leads both the piped path and MPI_Allreduce from 1 to 16 MiB (docs/performance.md).
# At 2 ranks it moves what MPI_Allreduce moves, through the same single-copy transport
# (Open MPI's CMA), and only ties it: not worth the trials there. Tuned on a 2-core machine;
# `hpctrain bench allreduce` on yours shows where the ring leads.
RING_CANDIDATE_BYTES = 1024 * 1024
RING_CANDIDATE_RANKS = 3


def choose_algorithm(nbytes: int, topology: Topology, requested: str = "auto", shared: bool = False,
                     small_shm: int = 0, cross_node: Tuple[int, int] = CROSS_NODE) -> str:
    """The algorithm a collective of ``nbytes`` uses on ``topology``.

    ``small_shm``: the largest message the node's shared-memory flag exchange takes for this
    dtype (0: not available — no C extension, or a dtype its kernels lack); up to that size
    one node's all-reduce is one flag round trip, above it streams through the flag slots;
    both faster than MPI_Allreduce. ``cross_node``: (ring from, hierarchical from) in bytes,
    for groups that span nodes (the group's settings; CROSS_NODE by default).

    Depends only on values that agree on every rank (message size, dtype, group layout,
    whether the data lives in a shared buffer), so every rank of a group picks the same one.
    """
    if requested not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {requested!r}; valid: {', '.join(ALGORITHMS)}")
    if requested != "auto":
        if requested in ("shm", "hierarchical") and not topology.single_node:
            # shared memory never spans nodes: across nodes, shm means hierarchical, which
            # needs the same number of ranks on every node
            return "hierarchical" if topology.homogeneous else "ring"
        if requested == "hierarchical":
            return "shm"  # one node: the hierarchical path is the shared-memory one
        return requested
    if topology.size == 1:
        return "native"
    if topology.single_node:
        if 0 < nbytes <= small_shm:
            return "shm"
        if shared:
            return "shm" if nbytes >= SHARED_SMALL_BYTES else "native"
        if 0 < nbytes < LARGE_RING_BYTES and small_shm:
            return "shm"
        return "ring" if nbytes >= LARGE_RING_BYTES else "native"
    ring_from, hierarchical_from = cross_node
    if nbytes >= hierarchical_from and topology.homogeneous:
        return "hierarchical"
    return "ring" if nbytes >= ring_from else "native"


# Across nodes auto chooses at run time from here: below it MPI_Allreduce leads by far (the
# ring's and the hierarchical path's extra steps are pure latency), above it the leader
# depends on the network, the MPI library and the node layout (the 2-node table of
# docs/performance.md: the ring ties MPI_Allreduce at 256 KiB, the hierarchical path goes from
# 0.5x to 2.8x of it between 256 KiB and 4 MiB).
CROSS_NODE_TUNING_BYTES = 128 * 1024


def tuning_candidates(nbytes: int, topology: Topology, small_shm: int, pipes: bool,
                      cross_node: Tuple[int, int] = CROSS_NODE) -> Tuple[str, ...]:
    """The algorithms ``auto`` chooses among at run time for a private buffer of ``nbytes``
    (hpctrain.comm.tuning), the expected winner first; empty where the fixed choice of
    ``choose_algorithm`` stands (small messages, no shared-memory flags on one node).

    On one node, above the flag exchange: there the winner flips with where the host puts
    the cores (the piped path 1.2–1.5× MPI_Allreduce in one placement, 0.3× in the other;
    docs/performance.md). The ring joins from RING_CANDIDATE_BYTES at 3 ranks or more.
    Across nodes, from CROSS_NODE_TUNING_BYTES: MPI_Allreduce, the ring and (same number of
    ranks on every node) the hierarchical path, the fixed choice first (``cross_node``);
    ``route`` sends the sizes that ride on the agreement check there instead.
    """
    if topology.size == 1:
        return ()
    if not topology.single_node:
        if nbytes < CROSS_NODE_TUNING_BYTES:
            return ()
        fixed = choose_algorithm(nbytes, topology, "auto", False, 0, cross_node)
        rest = ("native", "ring", "hierarchical") if topology.homogeneous else ("native", "ring")
        return (fixed,) + tuple(a for a in rest if a != fixed)
    if not small_shm or nbytes <= small_shm:
        return ()
    if nbytes < LARGE_RING_BYTES:
        if not pipes:
            return ()
        ring_too = topology.size >= RING_CANDIDATE_RANKS and nbytes >= RING_CANDIDATE_BYTES
        return ("shm", "native", "ring") if ring_too else ("shm", "native")
    return ("ring", "shm", "native") if pipes else ("ring", "native")


# --------------------------------------------------------------------------- all-reduce route
# How an all-reduce runs, one kind per executor branch (collectives._execute):
#   local      one rank, or nothing to reduce: no data moves (the agreement check still runs)
#   flags      one flag exchange on one node (data up to the flag slot), agreement included
#   tuned      local rank 0 picks among ``candidates`` at run time (tuning.py)
#   piped      a private buffer streamed through the flag slots, agreement on its first flag
#   zero-copy  data already in a shared buffer, reduced in the window (``algorithm`` shm or
#              hierarchical: the latter with a ring across nodes)
#   shm / hierarchical   through a whole-buffer window (no flag kernels, or several nodes)
#   ring / native        the ring in C, or MPI_Allreduce
ROUTE_KINDS = ("local", "flags", "tuned", "piped", "zero-copy", "shm", "hierarchical", "ring", "native")


@dataclass(frozen=True)
class Route:
    """The path one all-reduce takes; ``algorithm``: the name its agreement header carries
    ("auto" for a run-time choice), the same on every rank that takes this route; ``auto``:
    ``auto`` chose it (a requested algorithm runs as asked: no in-band native route)."""

    kind: str
    algorithm: str
    candidates: Tuple[str, ...] = ()
    auto: bool = field(default=False, compare=False)  # how it was chosen, not where it goes

    def __post_init__(self) -> None:
        if self.kind not in ROUTE_KINDS:
            raise ValueError(f"unknown route kind {self.kind!r}; valid: {', '.join(ROUTE_KINDS)}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r} in a route; valid: {', '.join(ALGORITHMS)}")
        if (self.kind == "tuned") != bool(self.candidates):
            raise ValueError(f"a {self.kind} route with candidates {self.candidates!r}: only 'tuned' has them")


def route(nbytes: int, topology: Topology, requested: str = "auto", *, shared: bool = False, small_shm: int = 0,
          pipes: bool = False, autotune: bool = False, cross_node: Tuple[int, int] = CROSS_NODE,
          inband: int = 0) -> Route:
    """The route of an all-reduce of ``nbytes`` on ``topology``: the one decision every path of
    ``collectives`` takes (the general one and the lean one for small numpy arrays).

    ``requested``: the caller's algorithm after the HPCTRAIN_ALLREDUCE override; ``shared``:
    the data lives in a shared buffer; ``small_shm``: the largest flag exchange for this dtype
    (0: none); ``pipes``: the piped path takes this size and dtype; ``autotune``: the group's
    run-time choice is on; ``cross_node``: see ``choose_algorithm``; ``inband``: the largest
    all-reduce of this dtype whose data can ride on the agreement check over MPI (0: none):
    up to it ``auto`` takes that path (a native route the check carries) instead of a run-time
    choice, since recursive doubling with the data on the check beat `MPI_Allreduce`, the ring
    and the tuned choice across nodes up to 256 KiB (docs/performance.md). Every argument
    agrees across the ranks of a group, so every rank takes the same route and sends the same
    agreement header.
    """
    algo = choose_algorithm(nbytes, topology, requested, shared, small_shm, cross_node)
    # Across nodes a shared buffer's data rides on the check too (the gradient buckets: measured
    # there); on one node (no flags) it keeps the zero-copy path it had.
    if requested == "auto" and 0 < nbytes <= inband and topology.size > 1 and not (shared and topology.single_node):
        return Route("native", "native", auto=True)
    if requested == "auto" and autotune and not shared:
        candidates = tuning_candidates(nbytes, topology, small_shm, pipes, cross_node)
        if candidates:
            return Route("tuned", "auto", candidates)
    if algo == "shm" and 0 < nbytes <= small_shm:
        return Route("flags", "shm")
    if topology.size == 1 or nbytes == 0:
        return Route("local", algo)
    if algo in ("shm", "hierarchical"):
        if shared:
            return Route("zero-copy", algo)
        if algo == "shm" and pipes:
            return Route("piped", "shm")
    return Route(algo, algo, auto=requested == "auto")
