"""Adasum over MPI: walks ``adasum_plan.schedule`` with paired ``Sendrecv`` messages.

The ranks agree on the call first (the agreement check: shapes, dtype), then the dtype and
the rank count are checked — the same verdict on every rank, so a bad call raises everywhere
and nothing waits. Every message runs inside the stall watchdog.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from . import adasum_plan, asyncq, guard
from .buffers import flatten
from .world import Group, resolve, watchdog

# Tags on the group's ring communicator: collectives of one group run one at a time, and MPI
# does not let messages of one sender, tag and communicator overtake each other, so the
# halves, the partial sums and the gathered results of one call match in order.
_TAG_HALF, _TAG_SUMS, _TAG_GATHER = 7401, 7402, 7403


def grouped_adasum_(xs: Sequence[Any], group: Optional[Group] = None) -> List[Any]:
    """Combine each numpy array / contiguous CPU tensor of ``xs`` over the ranks of ``group``
    by Adasum, in place (one fused exchange; each array gets its own coefficients). Every
    rank passes the same shapes and one floating dtype (float16, float32 or float64); the
    group's size must be a power of two. Returns ``xs``."""
    g = resolve(group)
    asyncq.drain()
    flats = [flatten(x, writable=True, what="adasum") for x in xs]
    names = sorted({f.dtype_name for f in flats})
    name = names[0] if len(names) == 1 else "mixed"
    total = sum(f.array.size for f in flats)
    shape = guard.grouped_shape([f.shape for f in flats])
    dog = watchdog()
    header = guard.make_header(0, "adasum", "-", name, guard.count_word(shape, total))
    guard.agree(g, header, dog, shape)
    if len(names) > 1 or (names and names[0] not in adasum_plan.DTYPES):
        raise ValueError(f"Adasum combines float16, float32 or float64 arrays of one dtype, got {names}.\n"
                         "HINT: cast the tensors to a floating dtype (or reduce integers with op=Sum)")
    if not adasum_plan.is_power_of_two(g.size):
        raise ValueError(f"Adasum needs a power-of-two number of ranks; group '{g.name}' has {g.size}.\n"
                         "HINT: run on 1, 2, 4, 8 … ranks, or reduce with op=Average")
    if g.size == 1 or total == 0:
        return list(xs)
    arrays = [f.array.reshape(-1) for f in flats]
    fused = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    what = lambda: guard.describe_header(header, shape) + f" on {g.name}"  # noqa: E731 - for a stall report
    _reduce_(g, fused, adasum_plan.offsets([a.size for a in arrays]), dog, what)
    if fused is not arrays[0]:
        offset = 0
        for a in arrays:
            np.copyto(a, fused[offset:offset + a.size])
            offset += a.size
    return list(xs)


def _reduce_(g: Group, buf: np.ndarray, bounds: np.ndarray, dog, what) -> None:
    """The halving levels (swap halves, sum the partial products over the block, combine),
    then the doubling levels that hand every rank the whole result."""
    levels = adasum_plan.schedule(g.rank, g.size, buf.size)
    recv = np.empty_like(buf)
    for lv in levels:
        keep, give = slice(*lv.keep), slice(*lv.give)
        _swap(g, dog, what, lv.neighbor, buf[give], recv[keep], _TAG_HALF)
        sums = adasum_plan.segment_sums(buf[keep], recv[keep], lv.keep[0], bounds, lv.left)
        tmp = np.empty_like(sums)
        for partner in adasum_plan.block_partners(g.rank, lv.distance):
            _swap(g, dog, what, partner, sums, tmp, _TAG_SUMS)
            sums += tmp  # addition commutes exactly: both partners hold the same bits after it
        adasum_plan.scaled_add_(buf[keep], recv[keep], lv.keep[0], bounds, sums, lv.left)
    for lv in reversed(levels):
        _swap(g, dog, what, lv.neighbor, buf[slice(*lv.keep)], buf[slice(*lv.give)], _TAG_GATHER)


def _swap(g: Group, dog, what, peer: int, send: np.ndarray, recv: np.ndarray, tag: int) -> None:
    """One paired exchange with ``peer`` (as bytes: float16 needs no MPI type)."""
    with dog.watch(what, lambda: g.describe_ranks([peer])):
        g.ring_comm.Sendrecv(send.view(np.uint8), dest=peer, sendtag=tag,
                             recvbuf=recv.view(np.uint8), source=peer, recvtag=tag)
