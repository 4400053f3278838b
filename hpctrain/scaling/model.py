"""Closed-form α-β-γ costs of one all-reduce on ``nodes × ranks_per_node`` ranks.

Every cost walks the runtime's own plan (``hpctrain.comm.plan``): the ring's step count and
chunk sizes come from :func:`~hpctrain.comm.plan.ring_schedule`, its messages per step from
:func:`~hpctrain.comm.plan.segments`, the hierarchical path's node-local slices from
:func:`~hpctrain.comm.plan.chunk_bounds` — so a change to the schedule changes the prediction.

Levels: ``intra`` (one node's ranks: shared memory, or PCIe/NVLink between GPUs), ``inter``
(a node's network port, shared by the node's ranks when several send at once) and ``gamma``
(bytes per second one rank reduces: ``a += b`` over its data). A message of ``b`` bytes on a
link costs ``α + b/β``; reducing ``b`` bytes costs ``b/γ``.

Algorithms:

- ``ring``: hpctrain's ring over all ranks (node by node): 2(P−1) steps of one chunk; a step
  is as slow as its slowest link (the inter-node one when there are several nodes).
- ``hierarchical``: hpctrain's shared-memory path across nodes: copy in, reduce the
  node-local slice, ring that slice across nodes (``ranks_per_node`` rings at once, sharing
  the node's port), copy out. On one node: ``shm`` (no ring).
- ``recursive_doubling``, ``tree``, ``rabenseifner``: textbook estimates of MPI_Allreduce's
  algorithms (Thakur, Rabenseifner & Gropp 2005), for comparison; the MPI library picks among
  them by size, which the model does not know.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Dict, Tuple

from hpctrain.comm import plan

from .fabrics import Link

__all__ = ["Machine", "ALGORITHMS", "allreduce_time", "ring_time", "hierarchical_time", "shm_time",
           "DEFAULT_SEGMENT_BYTES"]

ALGORITHMS = ("ring", "hierarchical", "recursive_doubling", "tree", "rabenseifner")

# The C ring's segment (hpctrain.comm.mpiring.SEGMENT_BYTES, HPCTRAIN_RING_SEGMENT_BYTES):
# repeated here as a number because importing that module loads the ring's C extension.
DEFAULT_SEGMENT_BYTES = 512 * 1024


@dataclass(frozen=True)
class Machine:
    """The machine a prediction is for: ``nodes`` × ``ranks_per_node`` ranks and the cost of
    each level. ``segment_bytes``: the ring's pipelining segment."""

    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link
    gamma_Bps: float
    segment_bytes: int = DEFAULT_SEGMENT_BYTES

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"need at least 1 node and 1 rank per node, got {self.nodes} × {self.ranks_per_node}")
        if not self.gamma_Bps > 0:
            raise ValueError(f"reduction throughput gamma must be > 0 bytes/s, got {self.gamma_Bps!r}")
        if self.segment_bytes < 1:
            raise ValueError(f"segment size must be >= 1 byte, got {self.segment_bytes}")

    @property
    def size(self) -> int:
        return self.nodes * self.ranks_per_node

    def with_nodes(self, nodes: int) -> "Machine":
        return Machine(nodes, self.ranks_per_node, self.intra, self.inter, self.gamma_Bps, self.segment_bytes)


@lru_cache(maxsize=4096)
def ring_time(numel: int, itemsize: int, ranks: int, link: Link, gamma_Bps: float, segment_bytes: int) -> float:
    """hpctrain's ring all-reduce of ``numel`` elements over ``ranks`` ranks whose slowest hop
    is ``link``: each step sends one chunk (as segments), reduce-scatter steps also reduce it.
    Rank 0's schedule stands for all: chunks differ by at most one element between ranks.
    Cached: a plan asks for the same sizes at every threshold and algorithm."""
    if ranks <= 1 or numel == 0:
        return 0.0
    seg = max(1, segment_bytes // itemsize)
    sched = plan.ring_schedule(numel, ranks, 0, seg)
    total = 0.0
    for phase, reduces in ((sched.reduce_scatter, True), (sched.allgather, False)):
        for st in phase:
            a, b = st.recv
            n = b - a
            messages = 1 if st.single else len(plan.segments(a, b, seg))
            total += link.time(n * itemsize, max(1, messages))
            if reduces:
                total += n * itemsize / gamma_Bps
    return total


def shm_time(numel: int, itemsize: int, local: int, intra: Link, gamma_Bps: float) -> float:
    """One node's shared-memory all-reduce (``comm.algorithms.shm_``): copy in, a barrier,
    reduce this rank's slice from the ``local − 1`` others, a barrier, copy every slice out.
    ``intra.bandwidth_Bps`` is one rank's copy bandwidth with all of them copying at once."""
    if local <= 1 or numel == 0:
        return 0.0
    bounds = plan.chunk_bounds(numel, local)
    slice_bytes = max(b - a for a, b in bounds) * itemsize
    nbytes = numel * itemsize
    return 2 * intra.alpha_s + 2 * nbytes / intra.bandwidth_Bps + (local - 1) * slice_bytes / gamma_Bps


def hierarchical_time(numel: int, itemsize: int, m: Machine) -> float:
    """Shared memory on each node around one ring per local rank across nodes: every local
    rank rings its node-local slice, the node's ``ranks_per_node`` rings sharing its port."""
    local = m.ranks_per_node
    inside = shm_time(numel, itemsize, local, m.intra, m.gamma_Bps)
    if m.nodes == 1:
        return inside
    if local == 1:
        inside = 0.0
    bounds = plan.chunk_bounds(numel, local)
    slice_elems = max(b - a for a, b in bounds)
    port = m.inter.shared(local)
    return inside + ring_time(slice_elems, itemsize, m.nodes, port, m.gamma_Bps, m.segment_bytes)


def _flat_ring_time(numel: int, itemsize: int, m: Machine) -> float:
    if m.nodes == 1:
        hop = m.intra
    elif m.ranks_per_node == 1:
        hop = m.inter  # every hop leaves the node
    else:
        hop = _slowest(m.intra, m.inter, numel * itemsize / m.size)
    return ring_time(numel, itemsize, m.size, hop, m.gamma_Bps, m.segment_bytes)


def _slowest(a: Link, b: Link, nbytes: float) -> Link:
    return a if a.time(nbytes) >= b.time(nbytes) else b


def _round_link(m: Machine, distance: int) -> Link:
    """The link a round of a recursive algorithm crosses when partners are ``distance`` ranks
    apart: inside the node, or the node's port shared by all its ranks at once."""
    return m.intra if distance < m.ranks_per_node else m.inter.shared(m.ranks_per_node)


def _recursive_doubling(numel: int, itemsize: int, m: Machine) -> float:
    """log2 P rounds, each exchanging and reducing the whole buffer."""
    n = numel * itemsize
    rounds = math.ceil(math.log2(m.size)) if m.size > 1 else 0
    return sum(_round_link(m, 1 << k).time(n) + n / m.gamma_Bps for k in range(rounds))


def _tree(numel: int, itemsize: int, m: Machine) -> float:
    """Binomial-tree reduce then broadcast: 2·log2 P rounds of the whole buffer."""
    n = numel * itemsize
    rounds = math.ceil(math.log2(m.size)) if m.size > 1 else 0
    return sum(2 * _round_link(m, 1 << k).time(n) + n / m.gamma_Bps for k in range(rounds))


def _rabenseifner(numel: int, itemsize: int, m: Machine) -> float:
    """Recursive-halving reduce-scatter then recursive-doubling all-gather (MPI's usual
    large-message algorithm): round k moves n/2^(k+1) bytes each way."""
    n = numel * itemsize
    rounds = math.ceil(math.log2(m.size)) if m.size > 1 else 0
    total = 0.0
    for k in range(rounds):
        part = n / (2 ** (k + 1))
        link = _round_link(m, m.size >> (k + 1) or 1)
        total += 2 * link.time(part) + part / m.gamma_Bps
    return total


_COSTS: Dict[str, Callable[[int, int, Machine], float]] = {
    "ring": _flat_ring_time,
    "hierarchical": hierarchical_time,
    "recursive_doubling": _recursive_doubling,
    "tree": _tree,
    "rabenseifner": _rabenseifner,
}


def allreduce_time(algorithm: str, numel: int, itemsize: int, m: Machine) -> float:
    """Seconds one all-reduce of ``numel`` elements of ``itemsize`` bytes takes with
    ``algorithm`` on machine ``m`` (0 on one rank)."""
    if algorithm not in _COSTS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    if m.size == 1 or numel == 0:
        return 0.0
    return _COSTS[algorithm](numel, itemsize, m)


def best_algorithm(numel: int, itemsize: int, m: Machine) -> Tuple[str, float]:
    """The cheapest algorithm for one message, and its time."""
    times = {a: allreduce_time(a, numel, itemsize, m) for a in ALGORITHMS}
    name = min(times, key=times.__getitem__)
    return name, times[name]
