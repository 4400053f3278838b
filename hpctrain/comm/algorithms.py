"""All-reduce algorithms, each reducing a flat numpy array in place on a Group.

- native: the MPI library's MPI_Allreduce.
- ring: reduce-scatter then all-gather over point-to-point messages; each rank sends
  2(N−1)/N of the data; segments let the reduction of one overlap the transfer of the next.
- shm: ranks of one node copy into an MPI-3 shared window, each reduces its slice straight
  from its peers' slots, and everyone reads the result (one copy in, one copy out).
- hierarchical: shm reduce-scatter inside each node → ring across nodes among ranks with
  the same local rank → shm all-gather inside each node.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from mpi4py import MPI

from .. import settings
from . import mpiring, plan, shmsync
from .buffers import finish_average, reduce_into
from .watchdog import suffixed
from .windows import allocate_shared

# Ring segments: ≥ 1 MiB, since each message of the Python ring costs ~15 µs of Python.
PY_RING_SEGMENT_BYTES = 1 << 20


def ring_segment_bytes() -> int:
    """HPCTRAIN_RING_SEGMENT_BYTES, default PY_RING_SEGMENT_BYTES: the Python ring's segment."""
    return settings.rc.ring_segment_bytes or PY_RING_SEGMENT_BYTES


_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}
_MPI_BOOL_OPS = {"sum": MPI.BOR, "avg": MPI.BOR, "max": MPI.BOR, "min": MPI.BAND, "prod": MPI.BAND}
_native_f16 = {"ok": True}


def _mpi_op(op: str, dtype_name: str):
    return (_MPI_BOOL_OPS if dtype_name == "bool" else _MPI_OPS)[op]


# --------------------------------------------------------------------------- native
def native_(comm, arr: np.ndarray, op: str, dtype_name: str) -> None:
    """MPI_Allreduce in place. bfloat16 (no MPI type) is reduced in float32 and rounded back."""
    if dtype_name == "bfloat16" or (dtype_name == "float16" and not _native_f16["ok"]):
        _native_upcast_(comm, arr, op, dtype_name)
        return
    try:
        _allreduce_nan_(comm, arr, _mpi_op(op, dtype_name), op)
    except MPI.Exception:
        if dtype_name != "float16":
            raise
        _native_f16["ok"] = False  # this MPI has no float16 reductions
        _native_upcast_(comm, arr, op, dtype_name)
        return
    if op == "avg":
        finish_average(arr, comm.Get_size(), dtype_name)


def _allreduce_nan_(comm, arr: np.ndarray, mpi_op, op: str) -> None:
    """``MPI_Allreduce`` in place, with min and max of floats as numpy's (and every other
    algorithm's): NaN wherever any rank holds NaN. MPI leaves NaN to the implementation (Open
    MPI keeps or drops it by operand order), so a second all-reduce (MAX of a one-byte NaN
    mask) says where; it runs for float min/max only."""
    if op not in ("min", "max") or arr.dtype.kind != "f" or not arr.size:
        comm.Allreduce(MPI.IN_PLACE, arr, op=mpi_op)
        return
    mask = np.isnan(arr).view(np.uint8)
    comm.Allreduce(MPI.IN_PLACE, arr, op=mpi_op)
    comm.Allreduce(MPI.IN_PLACE, mask, op=MPI.MAX)
    arr[mask.view(bool)] = np.nan


def _native_upcast_(comm, arr: np.ndarray, op: str, dtype_name: str) -> None:
    import torch

    if dtype_name == "bfloat16":
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        wide = t.float().numpy()
    else:
        wide = arr.astype(np.float32)
    _allreduce_nan_(comm, wide, _MPI_OPS[op], op)
    if op == "avg":
        wide /= comm.Get_size()
    if dtype_name == "bfloat16":
        t.copy_(torch.from_numpy(wide))
    else:
        np.copyto(arr, wide, casting="unsafe")


# --------------------------------------------------------------------------- ring
def ring_(comm, arr: np.ndarray, op: str, dtype_name: str, dog, what,
          describe=lambda r: f"rank {r}", average_over: Optional[int] = None) -> None:
    """Ring all-reduce of ``arr`` in place on ``comm`` (a communicator only ring traffic uses).

    Bitwise-identical result on every rank: each chunk is reduced once, by its owner, and
    then copied to everyone. ``average_over`` overrides the divisor of 'avg' (hierarchical).
    The per-size schedule is cached (:func:`plan.ring_schedule`): a call costs its messages
    and reductions plus a few µs of Python.

    Chunks of several segments are pipelined (:func:`_ring_exchange`): segments arrive in a
    few cache-sized scratch slots and are reduced as they come, and in the last
    reduce-scatter step each finished segment of this rank's own chunk leaves for the right
    neighbour at once (the all-gather's first step starts while the reduction goes on).
    """
    size = comm.Get_size()
    if size > 1 and arr.size:
        code = mpiring.kernel_dtype_code(dtype_name)
        use_c = mpiring.known(comm) if code is not None else False
        if use_c is None:  # the first ring on this communicator: a collective agreement
            with dog.watch(suffixed(what, " (ring: which ring, C or Python)"), lambda: "a rank of this ring"):
                use_c = mpiring.usable(comm)
        if use_c:
            scratch = _scratch(comm, mpiring.scratch_elements(arr.size, size, arr.itemsize), arr.dtype)
            left_rank = (comm.Get_rank() - 1) % size
            with dog.watch(suffixed(what, " (ring)"), lambda: f"{describe(left_rank)} (left neighbour)"):
                mpiring.allreduce_(comm, arr, code, op, average_over or size, scratch)
            return
        seg = max(1, ring_segment_bytes() // arr.itemsize)
        sched = plan.ring_schedule(arr.size, size, comm.Get_rank(), seg)
        left, right = sched.left, sched.right
        scratch = _scratch(comm, min(sched.max_chunk, RING_SLOTS * seg), arr.dtype)
        red = "sum" if op == "avg" else op
        divisor = average_over or size
        finish = (lambda part: finish_average(part, divisor, dtype_name)) if op == "avg" else None
        sendrecv = comm.Sendrecv
        # Every rank must agree on whether the all-gather's first step was started early
        # (then it only receives): decided by the largest chunk, the same everywhere.
        fused = sched.max_chunk > seg
        forwarded = None
        last = len(sched.reduce_scatter) - 1
        with dog.watch(suffixed(what, " (ring)"), lambda: f"{describe(left)} (left neighbour)"):
            for k, st in enumerate(sched.reduce_scatter):
                if st.single and not (fused and k == last):
                    (sa, sb), (ra, rb) = st.send, st.recv
                    into = scratch[:rb - ra]
                    sendrecv(arr[sa:sb], dest=right, recvbuf=into, source=left)
                    reduce_into(arr[ra:rb], into, red, dtype_name)
                    if k == last and finish is not None:
                        finish(arr[ra:rb])
                else:
                    forwarded = _ring_exchange(comm, arr, st.send, st.recv, right, left, seg,
                                               scratch=scratch, reduce_op=red, dtype_name=dtype_name,
                                               forward=k == last, finish=finish if k == last else None)
            for k, st in enumerate(sched.allgather):
                (sa, sb), (ra, rb) = st.send, st.recv
                if k == 0 and fused:
                    recvs = [comm.Irecv(arr[a:b], source=left, tag=i)
                             for i, (a, b) in enumerate(plan.segments(ra, rb, seg))]
                    MPI.Request.Waitall(recvs)
                    MPI.Request.Waitall(forwarded)
                elif st.single:
                    sendrecv(arr[sa:sb], dest=right, recvbuf=arr[ra:rb], source=left)
                else:
                    _ring_exchange(comm, arr, st.send, st.recv, right, left, seg)
    elif op == "avg" and average_over:
        finish_average(arr, average_over, dtype_name)


# Segments in flight into one ring exchange's scratch: enough to overlap the transfer of the
# next segments with the reduction of this one, few enough to stay in cache (4 x 1 MiB
# against an 8 MiB scratch took a 16 MiB 2-rank ring from 0.91x to ~1.3x MPI_Allreduce).
RING_SLOTS = 4
# Tags are segment numbers, also for the segments sent on early: between two neighbours,
# messages with one tag leave in the order the receiver posts for them, and MPI keeps one
# sender's messages with one tag in order, so they match (and stay below MPI's 32767).


_SCRATCH: dict = {}  # id(communicator) → reusable receive buffer of the ring
_SCRATCH_VIEWS: dict = {}  # (id(communicator), count, dtype) → typed view of that buffer


def _scratch(comm, count: int, dtype) -> np.ndarray:
    """A receive buffer for ``count`` elements, reused across calls: a fresh ≥128 KiB array is
    an mmap whose pages fault in on first touch (~2 µs each), on every call. Keyed by the
    communicator object's id (one buffer per ring communicator; a recycled id only means a
    buffer is reused, which is harmless); the typed view is cached too."""
    key = (id(comm), count, dtype)
    view = _SCRATCH_VIEWS.get(key)
    if view is not None:
        return view
    nbytes = count * np.dtype(dtype).itemsize
    buf = _SCRATCH.get(id(comm))
    if buf is None or buf.nbytes < nbytes:
        buf = _SCRATCH[id(comm)] = np.empty(max(nbytes, 1), dtype=np.uint8)
        _SCRATCH_VIEWS.clear()  # views of a replaced buffer must not be handed out again
    if len(_SCRATCH_VIEWS) > 256:
        _SCRATCH_VIEWS.clear()
    view = _SCRATCH_VIEWS[key] = buf[:nbytes].view(dtype)
    return view


def _ring_exchange(comm, arr, send_b, recv_b, right, left, seg, scratch=None, reduce_op=None,
                   dtype_name="", forward=False, finish=None):
    """Send one chunk to the right while receiving one from the left, segment by segment
    (chunks larger than one segment; ``ring_`` does a one-segment step with one Sendrecv).

    With ``scratch`` (room for ``RING_SLOTS`` segments), received segments land in its slots
    in turn and are reduced into ``arr`` as each arrives; otherwise they are received
    straight into place (all-gather). With ``forward``, each reduced segment (after
    ``finish``, the averaging) is sent on to the right at once; returns those requests.
    """
    recv_segs = plan.segments(*recv_b, seg)
    send_segs = plan.segments(*send_b, seg)
    if scratch is None:
        recvs = [comm.Irecv(arr[a:b], source=left, tag=i) for i, (a, b) in enumerate(recv_segs)]
        sends = [comm.Isend(arr[a:b], dest=right, tag=i) for i, (a, b) in enumerate(send_segs)]
        MPI.Request.Waitall(recvs)
        MPI.Request.Waitall(sends)
        return None
    slots = len(scratch) // seg

    def post(i):
        a, b = recv_segs[i]
        at = (i % slots) * seg
        return comm.Irecv(scratch[at:at + b - a], source=left, tag=i)

    recvs = [post(i) for i in range(min(slots, len(recv_segs)))]
    sends = [comm.Isend(arr[a:b], dest=right, tag=i) for i, (a, b) in enumerate(send_segs)]
    forwarded = []
    for i, (a, b) in enumerate(recv_segs):
        recvs[i].Wait()
        at = (i % slots) * seg
        reduce_into(arr[a:b], scratch[at:at + b - a], reduce_op, dtype_name)
        if i + slots < len(recv_segs):
            recvs.append(post(i + slots))
        if forward:
            if finish is not None:
                finish(arr[a:b])
            forwarded.append(comm.Isend(arr[a:b], dest=right, tag=i))
    MPI.Request.Waitall(sends)
    return forwarded if forward else None


# --------------------------------------------------------------------------- shared memory
def node_barrier(group, dog, what) -> None:
    """All local ranks of ``group`` arrived: a shared-memory flag round trip (~1 µs) where the
    flags exist, else an MPI barrier on the node communicator."""
    if group.node_flags is not None:
        group.node_flags.barrier(dog, what, _describe_local)
    else:
        with dog.watch(what, lambda: "a rank on this node"):
            group.node_comm.Barrier()


def _describe_local(local_ranks) -> str:
    return "local rank(s) " + ", ".join(str(r) for r in local_ranks) + " of this node"


class ShmArena:
    """An MPI-3 shared window on a node communicator: one slot per local rank, double-buffered
    (alternating halves) so that a new collective's copy-in never overwrites what a slower
    peer is still reading from the previous one — saving a barrier per collective."""

    MIN_CAPACITY = 1 << 20

    def __init__(self, node_comm) -> None:
        self.comm = node_comm
        self.capacity = 0
        self.win = None
        self.views = []
        self.parity = 0

    def ensure(self, nbytes: int) -> None:
        if nbytes <= self.capacity:
            return
        capacity = max(self.MIN_CAPACITY, 1 << (nbytes - 1).bit_length())
        self.free()
        self.win = allocate_shared(2 * capacity, self.comm)
        self.views = []
        for q in range(self.comm.Get_size()):
            buf, _ = self.win.Shared_query(q)
            self.views.append(np.frombuffer(buf, dtype=np.uint8))
        self.capacity = capacity

    def slots(self, nbytes: int, dtype) -> list:
        """Every local rank's slot for this collective, as arrays of ``dtype``."""
        off = self.parity * self.capacity
        self.parity ^= 1
        return [v[off:off + nbytes].view(dtype) for v in self.views]

    def free(self) -> None:
        if self.win is not None:
            self.comm.Barrier()  # nobody may still read the old window
            self.views = []
            self.win.Free()
            self.win = None
            self.capacity = 0


def pipes(group, nbytes: int, dtype_name: str, cross: bool = False) -> bool:
    """Whether ``shm_`` streams an all-reduce of ``nbytes`` through the node's flag slots (the
    piped path) rather than a whole-buffer window. Callers ask this too, to hand the piped
    path their agreement header instead of exchanging it first."""
    flags = group.node_flags
    return (flags is not None and not cross and shmsync.kernel_dtype_code(dtype_name) is not None
            and flags.pipes(nbytes))


def shm_(group, src: np.ndarray, out: np.ndarray, op: str, dtype_name: str, dog, what,
         cross: bool = False, header: Optional[bytes] = None, shape=None) -> None:
    """All-reduce through the node's shared window; with ``cross``, the hierarchical variant
    (each node-local slice is ring-all-reduced across nodes before everyone reads it).

    On one node with shared-memory flags, a buffer larger than a flag slot streams through
    the slots in cache-sized segments (``NodeFlags.allreduce_piped``: the buffer read and
    written once); otherwise (no C extension, a dtype its kernels lack, or ``cross``) the
    whole buffer is copied into this rank's slot of a window, reduced slice by slice and
    copied back out.

    ``src`` and ``out`` may be the same array. ``header``: the packed agreement check, for the
    piped path to carry on its first flag (the caller then skips its own agreement exchange);
    ``shape``: the caller's, named if that check fails on a shape.
    """
    if pipes(group, src.nbytes, dtype_name, cross):
        if out is not src:
            np.copyto(out, src)
        group.node_flags.allreduce_piped(out, shmsync.kernel_dtype_code(dtype_name), op, group.size, header, dog,
                                         what, _describe_local, group, shape)
        return
    node = group.node_comm
    local_size, local_rank = node.Get_size(), node.Get_rank()
    if group.shm_arena is None:
        group.shm_arena = ShmArena(node)
    arena = group.shm_arena
    arena.ensure(src.nbytes)
    slots = arena.slots(src.nbytes, src.dtype)
    mine = slots[local_rank]
    bounds = plan.chunk_bounds(src.size, local_size)
    a, b = bounds[local_rank]
    red = "sum" if op == "avg" else op
    np.copyto(mine, src)
    node_barrier(group, dog, suffixed(what, " (shared-memory copy-in)"))
    for q in range(local_size):
        if q != local_rank:
            reduce_into(mine[a:b], slots[q][a:b], red, dtype_name)
    if cross and group.cross_size > 1:
        cross_comm = group.cross_ring_comm
        ring_(cross_comm, mine[a:b], op, dtype_name, dog, suffixed(what, " (inter-node ring)"),
              describe=lambda r: f"the rank with local rank {local_rank} on node {r}",
              average_over=group.size)
    elif op == "avg":
        finish_average(mine[a:b], group.size, dtype_name)
    node_barrier(group, dog, suffixed(what, " (shared-memory reduce)"))
    for q in range(local_size):
        qa, qb = bounds[q]
        if qb > qa:
            np.copyto(out[qa:qb], slots[q][qa:qb])


# --------------------------------------------------------------------------- zero-copy buffers
class SharedBuffer:
    """Memory hpctrain owns inside the node's shared window: one slot per local rank, each
    with the same shape and dtype. Write your data into ``array`` (or ``tensor``); an
    all-reduce on it (or on any contiguous view into it, e.g. a gradient bucket) reduces with
    no copy in or out: each rank reduces its slice straight from its peers' slots and writes
    the result into every slot, so every rank finds the result in place.
    """

    def __init__(self, group, count: int, dtype, dtype_name: str) -> None:
        self.group = group
        self.dtype = np.dtype(dtype)
        self.dtype_name = dtype_name
        self.count = count
        nbytes = max(count * self.dtype.itemsize, 1)
        self.win = allocate_shared(nbytes, group.node_comm)
        self.slots = []
        for q in range(group.node_comm.Get_size()):
            buf, _ = self.win.Shared_query(q)
            self.slots.append(np.frombuffer(buf, dtype=np.uint8)[:count * self.dtype.itemsize].view(self.dtype))
        self.array = self.slots[group.node_comm.Get_rank()]
        self.base = self.array.__array_interface__["data"][0]
        self.end = self.base + count * self.dtype.itemsize

    def tensor(self):
        """A torch view of this rank's slot (bfloat16 when created with that dtype)."""
        import torch

        if self.dtype_name == "bfloat16":
            return torch.from_numpy(self.array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(self.array)

    def locate(self, arr: np.ndarray):
        """Element offset of ``arr`` inside this rank's slot, or None if it lies elsewhere."""
        ptr = arr.__array_interface__["data"][0]
        if self.base <= ptr and ptr + arr.nbytes <= self.end and arr.dtype.itemsize == self.dtype.itemsize:
            offset, rem = divmod(ptr - self.base, self.dtype.itemsize)
            return None if rem else offset
        return None

    def free(self) -> None:
        if self.win is not None:
            self.group.node_comm.Barrier()
            self.slots, self.array = [], None
            self.win.Free()
            self.win = None


def shm_zero_copy_(group, sbuf: SharedBuffer, offset: int, count: int, op: str, dtype_name: str, dog,
                   what: str, cross: bool = False, arrived: bool = False) -> None:
    """All-reduce elements [offset, offset+count) of every local rank's slot, in place.

    Barrier (all data written) → each rank reduces its slice from every slot → (across nodes:
    ring among the ranks owning the same slice) → writes it into every slot → barrier.
    ``arrived``: every local rank has passed a flag exchange since writing its data (the
    agreement check), which then serves as the first barrier.
    """
    node = group.node_comm
    local_size, local_rank = node.Get_size(), node.Get_rank()
    a, b = plan.chunk_bounds(count, local_size)[local_rank]
    code = shmsync.kernel_dtype_code(dtype_name)
    if code is not None and not (cross and group.cross_size > 1):
        # one pass in C: my slice of every slot reduced and written into every slot
        if not arrived:
            node_barrier(group, dog, suffixed(what, " (zero-copy: waiting for peers' data)"))
        if b > a:
            item = sbuf.dtype.itemsize
            where = [slot[offset + a:offset + b] for slot in sbuf.slots]
            shmsync.reduce_to_all(where, where, b - a, code, op, group.size,
                                  streaming=count * item * local_size > shmsync.streaming_bytes())
        node_barrier(group, dog, suffixed(what, " (zero-copy: waiting for peers' results)"))
        return
    views = [s[offset:offset + count] for s in sbuf.slots]
    mine = views[local_rank][a:b]
    red = "sum" if op == "avg" else op
    node_barrier(group, dog, suffixed(what, " (zero-copy: waiting for peers' data)"))
    for q in range(local_size):
        if q != local_rank:
            reduce_into(mine, views[q][a:b], red, dtype_name)
    if cross and group.cross_size > 1:
        ring_(group.cross_ring_comm, mine, op, dtype_name, dog, suffixed(what, " (inter-node ring)"),
              describe=lambda r: f"the rank with local rank {local_rank} on node {r}", average_over=group.size)
    elif op == "avg":
        finish_average(mine, group.size, dtype_name)
    for q in range(local_size):
        if q != local_rank and b > a:
            np.copyto(views[q][a:b], mine)
    node_barrier(group, dog, suffixed(what, " (zero-copy: waiting for peers' results)"))
