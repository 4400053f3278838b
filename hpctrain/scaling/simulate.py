"""Event-time simulation of the ring and hierarchical all-reduce, segment by segment.

Where :mod:`hpctrain.scaling.model` charges each ring step as a whole, this follows every
message the runtime's schedule sends (:func:`~hpctrain.comm.plan.ring_schedule`, split by
:func:`~hpctrain.comm.plan.segments`) through the port it leaves by:

- a message of ``b`` bytes costs its sender ``α`` (in parallel with the node's other
  senders), then holds the port it leaves by for ``b/β``; it has arrived when that ends. A
  port serves one message at a time, in the order the ranks behind it issue them (the ranks
  of a node share one network port);
- a segment can leave as soon as this rank has it: received (all-gather) or received and
  reduced (reduce-scatter; each rank reduces one segment at a time at ``γ``). So step k+1's
  first segment leaves while step k's last one is still on the wire: the pipelining the
  closed form does not see;
- a rank starts when it is ready (``start_s``: a straggler), and every port can be given its
  own link (a slow cable).

Every rank runs the same schedule shifted by its rank, whose chunks differ by at most one
element (``plan.chunk_bounds``): the simulation takes rank 0's chunk sizes for all and
vectorises over ranks: 4096 ranks take seconds per call, not hours.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from hpctrain.comm import plan

from .model import Machine

__all__ = ["SimResult", "simulate_ring", "simulate_hierarchical", "simulate", "straggler_effect"]


@dataclass(frozen=True)
class SimResult:
    """Per rank, when it finished (seconds from the earliest start); ``messages`` sent in all."""

    finish_s: np.ndarray
    messages: int

    @property
    def time_s(self) -> float:
        """When the last rank finished."""
        return float(self.finish_s.max())


def _ring_pass(ready0: np.ndarray, numel: int, itemsize: int, alpha: np.ndarray, bw: np.ndarray,
               gamma: np.ndarray, shared_port: bool, segment_bytes: int) -> SimResult:
    """``lanes`` independent rings of ``positions`` members each (arrays shaped
    (positions, lanes)); member (p, l) sends to (p+1, l). With ``shared_port`` the lanes at
    one position share that position's port (one node's ranks behind its network port)."""
    positions, lanes = ready0.shape
    seg = max(1, segment_bytes // itemsize)
    sched = plan.ring_schedule(numel, positions, 0, seg)
    port_free = np.zeros(positions if shared_port else (positions, lanes))
    sender_free = ready0.copy()
    cpu_free = ready0.copy()
    ready = ready0[:, :, None]
    messages = 0
    for steps, reduces in ((sched.reduce_scatter, True), (sched.allgather, False)):
        for st in steps:
            a, b = st.recv
            segs = [(a, b)] if st.single or b <= a else plan.segments(a, b, seg)
            new = np.empty((positions, lanes, len(segs)))
            for j, (sa, sb) in enumerate(segs):
                nbytes = (sb - sa) * itemsize
                rdy = ready[:, :, min(j, ready.shape[2] - 1)]
                sent = _send(rdy, sender_free, port_free, alpha, bw, nbytes, shared_port)
                got = np.roll(sent, 1, axis=0)  # position p receives what p-1 sent
                if reduces:
                    got = np.maximum(got, cpu_free) + nbytes / gamma
                    cpu_free = got
                new[:, :, j] = got
                messages += positions * lanes
            ready = new
    return SimResult(ready.max(axis=2), messages)


def _send(ready: np.ndarray, sender_free: np.ndarray, port_free: np.ndarray, alpha: np.ndarray, bw: np.ndarray,
          nbytes: int, shared_port: bool) -> np.ndarray:
    """When each member's message has arrived. The sender spends α on it (its own cost, in
    parallel with the other senders of its node), then the bytes take the port, which serves
    one message at a time. ``sender_free`` and ``port_free`` are updated in place."""
    issued = np.maximum(ready, sender_free) + alpha
    if not shared_port:
        end = np.maximum(issued, port_free) + nbytes / bw
        port_free[...] = end
    else:
        end = np.empty_like(ready)
        for lane in range(ready.shape[1]):  # the lanes behind one port, in lane order
            end[:, lane] = np.maximum(issued[:, lane], port_free) + nbytes / bw[:, lane]
            port_free[...] = end[:, lane]
    sender_free[...] = end
    return end


def _per_rank(m: Machine, start_s: Optional[Sequence[float]]) -> np.ndarray:
    start = np.zeros(m.size) if start_s is None else np.asarray(start_s, dtype=float)
    if start.shape != (m.size,):
        raise ValueError(f"start_s has {start.size} entries for {m.size} ranks")
    return start - start.min()


def simulate_ring(numel: int, itemsize: int, m: Machine, start_s: Optional[Sequence[float]] = None,
                  slow_link: Optional[tuple] = None) -> SimResult:
    """hpctrain's ring over all ranks, node by node: rank r sends to r+1 over the node's
    memory, or over the network where r+1 is on the next node. ``slow_link``: (rank, Link)
    for the link that rank sends on."""
    start = _per_rank(m, start_s)
    crosses = np.array([(r + 1) % m.size // m.ranks_per_node != r // m.ranks_per_node for r in range(m.size)])
    alpha = np.where(crosses, m.inter.alpha_s, m.intra.alpha_s)[:, None].astype(float)
    bw = np.where(crosses, m.inter.bandwidth_Bps, m.intra.bandwidth_Bps)[:, None].astype(float)
    if slow_link is not None:
        rank, link = slow_link
        alpha[rank, 0], bw[rank, 0] = link.alpha_s, link.bandwidth_Bps
    gamma = np.full((m.size, 1), m.gamma_Bps)
    if m.size == 1:
        return SimResult(start.copy(), 0)
    res = _ring_pass(start[:, None], numel, itemsize, alpha, bw, gamma, False, m.segment_bytes)
    return SimResult(res.finish_s[:, 0], res.messages)


def simulate_hierarchical(numel: int, itemsize: int, m: Machine, start_s: Optional[Sequence[float]] = None,
                          slow_link: Optional[tuple] = None) -> SimResult:
    """The shared-memory path across nodes: each node waits for its slowest rank (barrier),
    copies in and reduces its slices; local rank l of every node rings slice l across the
    nodes (the node's ranks share its port); a barrier; every rank copies the result out.
    ``slow_link``: (node, Link) for that node's port."""
    start = _per_rank(m, start_s).reshape(m.nodes, m.ranks_per_node)
    local, n_bytes = m.ranks_per_node, numel * itemsize
    bounds = plan.chunk_bounds(numel, local)
    slice_elems = max(b - a for a, b in bounds)
    copy = m.intra.alpha_s + n_bytes / m.intra.bandwidth_Bps if local > 1 else 0.0
    reduce = (local - 1) * slice_elems * itemsize / m.gamma_Bps
    node_ready = start.max(axis=1, keepdims=True) + copy + reduce
    ready = np.repeat(node_ready, local, axis=1)
    if m.nodes == 1:
        return SimResult((ready + copy).ravel(), 0)
    alpha = np.full((m.nodes, local), m.inter.alpha_s)
    bw = np.full((m.nodes, local), m.inter.bandwidth_Bps)
    if slow_link is not None:
        node, link = slow_link
        alpha[node, :], bw[node, :] = link.alpha_s, link.bandwidth_Bps
    gamma = np.full((m.nodes, local), m.gamma_Bps)
    res = _ring_pass(ready, slice_elems, itemsize, alpha, bw, gamma, True, m.segment_bytes)
    done = res.finish_s.max(axis=1, keepdims=True) + copy
    return SimResult(np.repeat(done, local, axis=1).ravel(), res.messages)


def simulate(algorithm: str, numel: int, itemsize: int, m: Machine, start_s: Optional[Sequence[float]] = None,
             slow_link: Optional[tuple] = None) -> SimResult:
    """``ring`` or ``hierarchical`` (the two schedules hpctrain runs across nodes)."""
    if algorithm == "ring":
        return simulate_ring(numel, itemsize, m, start_s, slow_link)
    if algorithm == "hierarchical":
        return simulate_hierarchical(numel, itemsize, m, start_s, slow_link)
    raise ValueError(f"simulate: algorithm {algorithm!r} is not simulated; valid: ring, hierarchical")


def straggler_effect(algorithm: str, numel: int, itemsize: int, m: Machine, delay_s: float,
                     rank: int = 0) -> float:
    """Seconds one rank arriving ``delay_s`` late adds to the all-reduce's finish, measured
    from when the others were ready (the collective is as late as its latest rank)."""
    start = np.zeros(m.size)
    start[rank] = delay_s
    return simulate(algorithm, numel, itemsize, m, start).time_s - simulate(algorithm, numel, itemsize, m).time_s

