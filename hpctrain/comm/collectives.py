"""Public collectives on numpy arrays and contiguous CPU torch tensors (and device tensors,
with a CUDA-aware MPI: ``device.py``).

Each one: resolve the group → agree (header check) → run under the watchdog → rebuild the
caller's type. Blocking calls wait for queued async ones first, so order is kept.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .. import settings
from . import algorithms, asyncq, device, guard, joining, mpiring, plan, shmsync, tuning
from .buffers import DTYPE_CODES, Flat, check_op, finish_average, flatten, is_torch_tensor, rebuild
from .device import accept_device_buffers, cuda_support  # noqa: F401 - public through hpctrain.comm
from .adasum import grouped_adasum_  # noqa: F401 - public through hpctrain.comm
from .errors import CollectiveMismatchError, CommError
from .world import Group, resolve, watchdog
from .world import _state as _world_state
from .watchdog import raise_translated


def _sync_start(group: Optional[Group]) -> Group:
    g = resolve(group)
    asyncq.drain()
    return g


def _all_ranks(g: Group):
    return lambda: f"one or more of the {g.size} ranks of group '{g.name}'"


_ENV_CHOICE = {"value": None}
_ASYNC = asyncq.STATE  # .started: an async collective may be queued (drain first)
_CHECKS = guard.CHECKS  # .on: the agreement check runs (an attribute read, on the lean path)


def requested_algorithm(algorithm: str) -> str:
    """The caller's choice, unless HPCTRAIN_ALLREDUCE (read once per process) overrides 'auto'."""
    if algorithm == "auto":
        if _ENV_CHOICE["value"] is None:
            _ENV_CHOICE["value"] = settings.rc.allreduce
        algorithm = _ENV_CHOICE["value"]
    if algorithm not in plan.ALGORITHMS:
        raise ValueError(
            f"unknown all-reduce algorithm {algorithm!r} (argument or HPCTRAIN_ALLREDUCE); "
            f"valid: {', '.join(plan.ALGORITHMS)}"
        )
    return algorithm


def choose_algorithm(nbytes: int, group: Optional[Group] = None, algorithm: str = "auto",
                     shared: bool = False, dtype: str = "float32") -> str:
    """The algorithm an all-reduce of ``nbytes`` of ``dtype`` would use on ``group``
    (``shared``: the data lives in a ``shared_buffer``) by the fixed thresholds; where
    ``auto`` chooses at run time (``tuned_counts``), the candidate it tries first."""
    g = resolve(group)
    return plan.choose_algorithm(nbytes, g.topology, requested_algorithm(algorithm), shared,
                                 _small_shm(g, str(dtype).replace("torch.", "")), g.cross_node)


def allreduce_route(nbytes: int, group: Optional[Group] = None, algorithm: str = "auto",
                    shared: bool = False, dtype: str = "float32") -> plan.Route:
    """The route (``plan.Route``: kind, header algorithm, run-time candidates) an all-reduce of
    ``nbytes`` of ``dtype`` takes on ``group``; ``shared``: the data lives in a ``shared_buffer``."""
    g = resolve(group)
    return _route(g, nbytes, str(dtype).replace("torch.", ""), requested_algorithm(algorithm), shared)


def tuned_counts(nbytes: int, group: Optional[Group] = None) -> Dict[str, int]:
    """How many of this process's ``auto`` all-reduces of about ``nbytes`` (same size class) ran
    each algorithm, as decided by the group's local rank 0 (on a group that spans nodes: its
    rank 0; empty elsewhere, or when nothing was tuned at that size)."""
    g = resolve(group)
    counts: Dict[str, int] = {}
    if g.tuner is not None:
        for (cls, _), per_algo in g.tuner.counts().items():
            if cls == tuning.size_class(nbytes):
                for name, n in per_algo.items():
                    counts[name] = counts.get(name, 0) + n
    return counts


def _small_shm(g: Group, dtype_name: str) -> int:
    """Largest all-reduce the group's flag exchange takes for this dtype (0: none)."""
    return g.small_shm if DTYPE_CODES.get(dtype_name, -1) in shmsync.FAST_DTYPES else 0


def _route(g: Group, nbytes: int, dtype_name: str, requested: str, shared: bool) -> plan.Route:
    """``plan.route`` with this group's facts: the one all-reduce decision, for every path.
    Cached on the group (deciding costs ~4 µs, a small all-reduce's whole budget): every
    input but the call's own is fixed while the group lives (its flags, topology, run-time
    choice and thresholds; ``Group.free`` drops the cache with the flags). The route does not
    depend on the agreement check: with the check off a small call's data rides on the check's
    messages all the same (``_native``), since across nodes they beat MPI_Allreduce."""
    key = ("route", nbytes, dtype_name, requested, shared)
    route = g.routes.get(key)
    if route is None:
        inband = g.inband if guard.inband_dtype(dtype_name) else 0
        route = plan.route(nbytes, g.topology, requested, shared=shared, small_shm=_small_shm(g, dtype_name),
                           pipes=algorithms.pipes(g, nbytes, dtype_name), autotune=g.autotune,
                           cross_node=g.cross_node, inband=inband)
        _cache(g, key, route)
    return route


def _cache(g: Group, key: tuple, decision: Any) -> None:
    if len(g.routes) >= _ROUTE_CACHE_ENTRIES:  # a program's kinds of all-reduce are few; bound it anyway
        g.routes.clear()
    g.routes[key] = decision


# --------------------------------------------------------------------------- all-reduce
def allreduce(x: Any, op: str = "sum", algorithm: str = "auto", group: Optional[Group] = None) -> Any:
    """Reduce ``x`` over the ranks of ``group``; return a new array/tensor with the result.

    op: sum | avg | min | max | prod. algorithm: auto | ring | native | shm | hierarchical
    (auto picks by size and topology; HPCTRAIN_ALLREDUCE overrides auto). min and max follow
    numpy's minimum and maximum on every algorithm: NaN on any rank gives NaN there (MPI
    leaves it to the implementation, so the native path marks NaN itself). Every rank must
    pass the same shape and dtype (checked, unless the agreement check is off).
    """
    g = _sync_start(group)
    if algorithm == "auto" and type(x) is np.ndarray and requested_algorithm("auto") == "auto" and not g.joined:
        lean = g.routes.get((x.nbytes, x.dtype, op, _CHECKS.on)) or _lean(g, x.nbytes, x.dtype, op)
        if lean.route is not None:
            out = np.array(x, order="C")  # private, contiguous and writable: the lean path takes it
            try:
                _run_lean(g, out, op, lean)
            except CollectiveMismatchError as e:  # ranks may have joined (_after_mismatch)
                return _after_mismatch(e, x, op, g, inplace=False)
            return out
    return _allreduce(x, op, algorithm, g, inplace=False)


def _after_mismatch(error: CollectiveMismatchError, x: Any, op: str, g: Group, inplace: bool, shape=None) -> Any:
    """An all-reduce whose agreement check failed: redone with the joined ranks adding zeros
    when that is why (joining.py); otherwise ``error`` is raised."""
    if not joining.ranks_joined(g, error):
        raise error
    return _joined_allreduce(x, op, g, inplace, shape, agreed=True)


def _joined_allreduce(x: Any, op: str, g: Group, inplace: bool, shape=None, agreed: bool = False) -> Any:
    """The all-reduce while ranks of ``g`` have joined: over MPI, the joined ranks adding zeros."""
    check_op(op)
    flat = flatten(x, writable=inplace, what="allreduce")
    out = flat.array if inplace else flat.array.copy()
    joining.allreduce_(g, out, op, flat.dtype_name, flat.shape if shape is None else shape, watchdog(), agreed)
    return x if inplace else rebuild(flat, out)


def allreduce_(x: Any, op: str = "sum", algorithm: str = "auto", group: Optional[Group] = None) -> Any:
    """In-place all-reduce; returns ``x``."""
    g = _world_state["world"] if group is None else group
    # The lean path: auto (no override) on a numpy array, with as little Python as possible. Its
    # route comes from the group's cache of _route's decisions (_lean); a flag exchange runs
    # right here, since at 1 KiB a helper's Python costs more than the exchange itself. While
    # ranks have joined it is skipped; a failed agreement check may mean that ranks have just
    # joined (_after_mismatch; try costs nothing).
    try:
        if (type(g) is Group and algorithm == "auto" and type(x) is np.ndarray and _ENV_CHOICE["value"] == "auto"
                and not g.joined):
            if _ASYNC.started:
                asyncq.drain()
            lean = g.routes.get((x.nbytes, x.dtype, op, _CHECKS.on)) or _lean(g, x.nbytes, x.dtype, op)
            if lean.flags:
                g.seq += 1
                dog = _world_state["watchdog"]  # g exists, so the world (and its watchdog) does
                # the agreement header (_flag_header, inlined): for a 1-D array the entry's, with
                # this call's sequence number put in by the exchange (packing costs ~0.3 µs)
                if x.ndim == 1:
                    header, header_seq = lean.header if _CHECKS.on else None, g.seq
                else:
                    header, header_seq = _PACK(g.seq, 0, lean.red, lean.code, guard.count_word(
                        x.shape, x.size), _SHM, 0, 0) if _CHECKS.on else None, -1
                try:
                    status = g.node_flags.ctx.exchange(header, x, lean.code, lean.kop, dog.timeout, header_seq)
                except (BufferError, ValueError):  # numpy: not C-contiguous / read-only; the general
                    g.seq -= 1                     # path says what to do (the exchange refused the
                    status = -1                    # buffer before it touched a flag)
                if status == 0:
                    return x
                if status > 0:
                    _exchange_failed(g, x, op, status, dog)
                    return x
            elif lean.inband is not None and x.ndim == 1 and x.flags.c_contiguous and x.flags.writeable and not (
                    g.shared_buffers and _find_shared(g, x) is not None):  # the data rides on the check, in C
                lean.inband(x, x.shape)
                return x
            elif lean.native is not None and not _CHECKS.on and x.ndim == 1 and x.flags.c_contiguous and (
                    x.flags.writeable and not (g.shared_buffers and _find_shared(g, x) is not None)):  # MPI_Allreduce, bound once
                lean.native(x)
                return x
            elif lean.tuned is not None and x.ndim == 1 and x.flags.c_contiguous and x.flags.writeable and not (
                    g.shared_buffers and _find_shared(g, x) is not None):  # auto's run-time choice, bound once
                lean.tuned(x, x.shape)
                return x
            elif lean.route is not None and _run_lean(g, x, op, lean):
                return x
            return _allreduce(x, op, algorithm, g, inplace=True)
        g = _sync_start(group)
        if algorithm == "auto" and type(x) is np.ndarray and requested_algorithm("auto") == "auto" and not g.joined:
            lean = g.routes.get((x.nbytes, x.dtype, op, _CHECKS.on)) or _lean(g, x.nbytes, x.dtype, op)
            if lean.route is not None and _run_lean(g, x, op, lean):
                return x
    except CollectiveMismatchError as e:
        return _after_mismatch(e, x, op, g, inplace=True)
    return _allreduce(x, op, algorithm, g, inplace=True)


def allreduce_now(x: Any, op: str = "sum", algorithm: str = "auto", group: Optional[Group] = None,
                  inplace: bool = False, agree_on=None) -> asyncq.Finished:
    """``allreduce_async`` for a caller that waits at once: run in the caller's thread after the
    queued async collectives; returns a finished handle (its ``wait()`` raises the error)."""
    g = resolve(group)
    check_op(op)
    arr = _numpy_view(x) if inplace and agree_on is None and algorithm == "auto" else None
    if arr is not None:  # the lean path, on the tensor's own memory: the same decision and header
        return asyncq.run_now(f"allreduce({op})", lambda: (allreduce_(arr, op, "auto", g), x)[1])
    return asyncq.run_now(f"allreduce({op})", lambda: _allreduce(x, op, algorithm, g, inplace, agree_on))


_SHARED_WITH_NUMPY: set = set()  # torch dtypes whose .numpy() shares the tensor's memory as is


def _numpy_view(x: Any) -> Optional[np.ndarray]:
    """A contiguous CPU torch tensor of a plain numeric dtype as a numpy array on its memory
    (same shape), for the lean path; None for anything else (the general path checks it)."""
    if not is_torch_tensor(x) or device.on_device(x) or not x.is_cpu or x.is_sparse or not x.is_contiguous():
        return None  # a device tensor takes MPI's own collective (_allreduce_now)
    if not _SHARED_WITH_NUMPY:
        import torch

        _SHARED_WITH_NUMPY.update((torch.float32, torch.float64, torch.float16, torch.int32, torch.int64))
    return x.detach().numpy() if x.dtype in _SHARED_WITH_NUMPY else None


def allreduce_async(x: Any, op: str = "sum", algorithm: str = "auto", group: Optional[Group] = None,
                    inplace: bool = False, agree_on=None, fusable: bool = False) -> asyncq.Handle:
    """Start an all-reduce on the background thread; ``handle.wait()`` returns the result.
    ``agree_on``: what the agreement check compares instead of the shape (``guard.named_shape``:
    the ranks' calls must also carry the same name). ``fusable`` (in-place host arrays with
    ``auto``): the background thread may fuse this call with the fusable all-reduces of the same
    op and dtype queued behind it (Horovod's tensor fusion; the ranks agree how many, at the
    price of one small all-reduce per fused batch: ``hvd.allreduce_async`` asks for it, the
    DistributedOptimizer's buckets, fused already, do not)."""
    g = resolve(group)
    check_op(op)
    fuse = None
    if device.on_device(x):
        device.ready(x)  # the caller's stream: the worker thread has its own
    else:
        flat = flatten(x, writable=inplace, what="allreduce_async")  # fail here, in the caller's thread
        if fusable and inplace and algorithm == "auto" and g.size > 1 and asyncq.fusion_threshold() > 0:
            fuse = asyncq.Fusable((id(g), op, flat.dtype_name), flat.array.nbytes,
                                  (x, flat.shape if agree_on is None else agree_on),
                                  lambda items: _fused_allreduce(items, op, g),
                                  lambda count: _agree_on_fusion(g, count))
    return asyncq.submit(f"allreduce_async({op})", lambda: _allreduce(x, op, algorithm, g, inplace, agree_on), fuse)


def _agree_on_fusion(g: Group, count: int) -> int:
    """How many queued fusable all-reduces every rank of ``g`` holds (a MIN all-reduce; a rank
    that has joined adds 0, and then each call runs alone, the joined rank standing in)."""
    agreed = np.array([count], dtype=np.int64)
    allreduce_(agreed, op="min", group=g)
    return max(1, int(agreed[0]))


def _fused_allreduce(items: Sequence[Tuple[Any, Any]], op: str, g: Group) -> List[Any]:
    """Run the fused async all-reduces ``items`` ((array, what its rank agrees on) pairs) as one
    grouped all-reduce whose agreement covers every call's shape and name, in order."""
    xs = [x for x, _ in items]
    _grouped_allreduce_(xs, op, g, ("grouped",) + tuple(guard.plain_shape(s) for _, s in items))
    return xs


_FAST_DTYPES = {np.dtype(name): DTYPE_CODES[name] for name in DTYPE_CODES
                if DTYPE_CODES[name] in shmsync.FAST_DTYPES}
_FAST_DTYPE_NAMES = {dtype: dtype.name for dtype in _FAST_DTYPES}  # dtype.name costs µs per call
_HEADER_OP = {op: guard.reduction_index(op) for op in shmsync.OP_CODES}
_KERNEL_OP = shmsync.OP_CODES
_PACK = shmsync.HEADER.pack
_ALLREDUCE = guard.operation_index("allreduce")
_SHM = guard.algorithm_index("shm")
_AUTO = guard.algorithm_index("auto")
_INT64 = DTYPE_CODES["int64"]
_SUM = shmsync.OP_CODES["sum"]
_LEAN_KINDS = ("flags", "piped", "tuned", "native")  # the lean path runs these (native: across nodes, 1 KiB costs a few µs of MPI)
_ROUTE_CACHE_ENTRIES = 4096  # Group.routes


def _flag_header(seq: int, op: str, code: int, word: int, algorithm: int) -> Optional[bytes]:
    """The agreement header that rides on a flag exchange or on the piped path's first flag
    (``guard.make_header``'s fields, packed), or None with the check off. ``allreduce_``'s
    flag exchange packs the same fields inline."""
    return _PACK(seq, _ALLREDUCE, _HEADER_OP[op], code, word, algorithm, 0, 0) if _CHECKS.on else None


class _Lean:
    """The lean path's entry for one (size, dtype, op) of a private numpy array with ``auto``:
    ``route`` (``_route``'s decision; None: the general path runs the call), ``flags``: a flag
    exchange whatever buffer holds the data (run inline by ``allreduce_``), the header's
    reduction index, the kernels' dtype and op codes."""

    __slots__ = ("route", "flags", "red", "code", "kop", "dtype_name", "header", "inband", "native", "tuned")

    def __init__(self, route: Optional[plan.Route], flags: bool = False, red: int = 0, code: int = 0,
                 kop: int = 0, dtype_name: str = "", count: int = 0) -> None:
        self.route, self.flags, self.red, self.code, self.kop, self.dtype_name = (
            route, flags, red, code, kop, dtype_name)
        # the flag exchange's header for a 1-D array of ``count`` elements, sequence number 0
        self.header = _PACK(0, _ALLREDUCE, red, code, count, _SHM, 0, 0) if flags else None
        # a native route whose data rides on the check in C (_checked_native's call for a
        # 1-D array, set by _lean), else None
        self.inband: Optional[guard.InbandCall] = None
        # a native route with the check off: its MPI_Allreduce bound (set by _lean), else None
        self.native: Optional[_NativeCall] = None
        # a tuned route: its _TunedCall or _TunedAcrossNodes (set by _lean), else None
        self.tuned: Optional[_BoundTuned] = None


_GENERAL = _Lean(None)


def _lean(g: Group, nbytes: int, dtype: np.dtype, op: str) -> _Lean:
    """Decide (``_route``) and cache on ``g`` the lean path's entry for an ``auto`` all-reduce of
    a private numpy array; the lean path looks it up, so both paths make one decision and send
    one agreement header (tests/mpi/test_comm_dispatch.py checks them against each other)."""
    entry = _GENERAL
    code = _FAST_DTYPES.get(dtype)
    if code is not None and op in _KERNEL_OP:
        name = _FAST_DTYPE_NAMES[dtype]
        route = _route(g, nbytes, name, "auto", False)
        if route.kind in _LEAN_KINDS:
            anywhere = route.kind == "flags" and _route(g, nbytes, name, "auto", True) == route
            count = nbytes // dtype.itemsize
            entry = _Lean(route, anywhere, _HEADER_OP[op], code, _KERNEL_OP[op], name, count)
            if route.kind == "native":
                checked = _checked_native(g, dtype, nbytes, (op, name, count, route.algorithm, 0, route.auto))
                inband = checked[1]
                entry.inband = inband if inband is not None and inband.run is not None else None
                if _NativeCall.plain(op, dtype):
                    entry.native = _NativeCall(g, op, name, count, route.algorithm)
            elif route.kind == "tuned":
                entry.tuned = _tuned_call(g, nbytes, op, name, code, count, route.candidates)
    _cache(g, (nbytes, dtype, op, _CHECKS.on), entry)  # its header and bound calls depend on the check
    return entry


class _NativeCall:
    """``_native`` with the agreement check off, for the lean path (a 1-D array of one size,
    dtype and op): MPI_Allreduce in place with its arguments bound once, its wait timed by a
    ``watchdog.ClockedWait`` (two stores, where a ``Wait`` costs about a microsecond: across
    nodes with more ranks than cores, several microseconds of the call's time). Only where
    ``algorithms.native_`` is a plain MPI_Allreduce (``plain``)."""

    __slots__ = ("group", "run", "wait", "average", "dtype_name")

    def __init__(self, g: Group, op: str, dtype_name: str, count: int, algo: str) -> None:
        self.group, self.average, self.dtype_name = g, op == "avg", dtype_name
        self.wait = _world_state["watchdog"].clocked(lambda: guard.describe_header(guard.make_header(
            g.seq, "allreduce", op, dtype_name, count, algo, 0)) + f" on {g.name}", _all_ranks(g))
        self.run = functools.partial(g.comm.Allreduce, MPI.IN_PLACE, op=algorithms._mpi_op(op, dtype_name))

    @staticmethod
    def plain(op: str, dtype: np.dtype) -> bool:
        """Whether ``native_`` is one MPI_Allreduce (not float min/max: NaN takes a second one)."""
        return op not in ("min", "max") or dtype.kind != "f"

    def __call__(self, x: np.ndarray) -> None:
        self.group.seq += 1
        self.reduce(x)

    def reduce(self, x: np.ndarray) -> None:
        """MPI_Allreduce of ``x`` in place; the caller has counted the call (``group.seq``)."""
        g = self.group
        clock = self.wait.clock
        clock[0] = _monotonic()
        try:
            self.run(x)
        except Exception as exc:
            raise_translated(exc)
        finally:
            clock[0] = 0.0
        if self.average:
            finish_average(x, g.size, self.dtype_name)


_monotonic = time.monotonic


def _run_lean(g: Group, x: np.ndarray, op: str, lean: _Lean) -> bool:
    """Run ``lean.route`` on ``x`` in place; False (nothing done) when ``x`` is not a private,
    contiguous, writable array (the general path then checks it and routes it)."""
    if not (x.flags.c_contiguous and x.flags.writeable) or (g.shared_buffers and _find_shared(g, x) is not None):
        return False
    _execute(g, lean.route, x, x, op, lean.dtype_name, x.shape)
    return True


def _native(g: Group, x: np.ndarray, op: str, dtype_name: str, algo: str, shape, extra: int = 0,
            inband: bool = False) -> None:
    """The native route (small all-reduces across nodes): MPI_Allreduce of ``x`` in place
    behind the agreement check, with little Python (across nodes with more ranks than cores
    every microsecond here is on every rank's critical path, about threefold). ``inband``
    (``auto`` chose the route): up to ``g.inband`` bytes the data rides on the check and no
    MPI_Allreduce runs (``guard.InbandCall``), with the check off too: its messages carry the
    data faster than MPI_Allreduce across nodes, and every rank takes the same route.
    ``shape``: what the ranks agree on; ``extra``: a shared buffer's offset + 1 (the header's
    field)."""
    dog = _world_state["watchdog"]
    word = guard.count_word(shape, x.size)
    if _CHECKS.on or inband:
        key = (op, dtype_name, word, algo, extra, inband)
        checked = g.routes.get(key) or _checked_native(g, x.dtype, x.nbytes, key)
        if checked[1] is not None:  # the data rides on the check
            checked[1](x, shape)
            return
        if not _CHECKS.on:
            g.seq += 1
        elif checked[2] is not None:  # the check alone, in C
            checked[2](0, shape)
        else:
            guard.agree(g, checked[0].copy(), dog, shape)
    else:
        g.seq += 1
    what = lambda: guard.describe_header(  # noqa: E731 - built only for a stall report
        guard.make_header(g.seq, "allreduce", op, dtype_name, word, algo, extra)) + f" on {g.name}"
    with dog.watch(what, _all_ranks(g)):
        algorithms.native_(g.comm, x, op, dtype_name)


def _checked_native(g: Group, dtype: np.dtype, nbytes: int, key: tuple) -> tuple:
    """What a checked native all-reduce of ``nbytes`` of ``dtype`` (``key``: its op, dtype name,
    count word, algorithm, header extra, whether auto chose it) sends, cached on ``g`` (building
    it costs a few µs, a small all-reduce's budget): its header (sequence 0); where its data
    rides on the check, the ``guard.InbandCall`` that runs it (None: MPI_Allreduce after the
    check); otherwise, where the check runs over MPI with room for in-band data, the
    ``DecisionCheck`` that checks it (None: ``guard.agree``)."""
    op, dtype_name, word, algo, extra, auto = key
    header = guard.make_header(0, "allreduce", op, dtype_name, word, algo, extra)
    inband = check = None
    if auto and nbytes <= g.inband and guard.inband_reducible(dtype_name, dtype, op):
        inband = guard.InbandCall(g, header, mpiring.inband_code(dtype_name, op), header.tobytes(), op, dtype_name,
                                  _world_state["watchdog"])
    else:
        check = DecisionCheck.for_group(g, header)
    checked = (header, inband, check)
    _cache(g, key, checked)
    return checked


class DecisionCheck:
    """The agreement check over MPI for one kind of call, with rank 0's decision (an int64) on
    it: an in-band all-reduce of that one number (a sum to which only rank 0 adds) under the
    call's own header, run by ``guard.InbandCall`` with everything bound once. ``guard.agree``
    runs the same C check but builds its header, watch text and buffers' lookup on every call:
    a few µs of Python, where more ranks than cores make every microsecond several of the
    call's.

    Every rank makes the same choice between this and ``guard.agree`` for a given header
    (``for_group`` reads only group-wide facts: ``group.inband``, the same on every rank); both
    send the check's messages, and a rank in another collective sends another header, a
    mismatch on every rank as in every check."""

    __slots__ = ("call", "value")

    def __init__(self, call: "guard.InbandCall") -> None:
        self.call = call
        self.value = np.zeros(1, np.int64)

    @classmethod
    def for_group(cls, g: Group, header: np.ndarray) -> Optional["DecisionCheck"]:
        """None where the check has no room for in-band data (on one node, or with
        HPCTRAIN_CHECK_INBAND_BYTES below 8)."""
        if g.inband < 8:
            return None
        return cls(guard.InbandCall(g, header, mpiring.inband_code("int64", "sum"), header.tobytes(), "sum", "int64",
                                    _world_state["watchdog"]))

    def __call__(self, decision: int, shape=None) -> int:
        """Check this call (``shape``: named if the ranks differ); rank 0's ``decision`` (the
        others pass 0) returned on every rank."""
        value = self.value
        value[0] = decision
        self.call(value, shape)
        return int(value[0])


def _allreduce(x: Any, op: str, algorithm: str, g: Group, inplace: bool, shape=None) -> Any:
    """The general all-reduce; ``shape``: what the ranks agree on, when not ``x``'s own (a
    grouped call's list of shapes, or ``guard.named_shape``). While ranks have joined, or when
    the agreement check finds that they just did, the joined ranks add zeros (joining.py)."""
    if g.joined:
        return _joined_allreduce(x, op, g, inplace, shape)
    try:
        return _allreduce_now(x, op, algorithm, g, inplace, shape)
    except CollectiveMismatchError as e:
        return _after_mismatch(e, x, op, g, inplace, shape)


def _allreduce_now(x: Any, op: str, algorithm: str, g: Group, inplace: bool, shape=None) -> Any:
    """Check, route, execute."""
    check_op(op)
    if device.on_device(x):  # MPI reads device memory itself: its own collective, no host kernels
        return device.allreduce(g, x, op, inplace)
    flat = flatten(x, writable=inplace, what="allreduce")
    _check_reducible(op, flat.dtype_name, flat.array)
    src = flat.array
    shared = _find_shared(g, src) if inplace else None
    route = _route(g, src.nbytes, flat.dtype_name, requested_algorithm(algorithm), shared is not None)
    out = src if inplace else np.empty_like(src)  # _execute fills it: a window route writes it, the rest copy src
    _execute(g, route, src, out, op, flat.dtype_name, flat.shape if shape is None else shape, shared)
    return x if inplace else rebuild(flat, out)


def _check_reducible(op: str, dtype_name: str, arr: np.ndarray) -> None:
    if op in ("min", "max") and arr.dtype.kind == "c":
        raise ValueError(f"allreduce: op {op!r} is not defined for complex dtype {dtype_name}.\n"
                         "HINT: reduce the real and imaginary parts (or the magnitudes) separately")


def _execute(g: Group, route: plan.Route, src, out, op: str, dtype_name: str, shape, shared=None) -> None:
    """Run ``route`` (``_route``'s decision): reduce ``src`` into ``out`` (the same array in
    place; a window route reads ``src`` and writes ``out``, every other copies first). For the
    piped and tuned routes ``out`` may be a list of arrays of one dtype, reduced as their
    concatenation (``src`` then is ``out``). ``shared``: (buffer, offset) of data in a shared
    buffer; ``shape``: what the ranks agree on."""
    kind = route.kind
    if out is not src and kind not in ("shm", "hierarchical"):
        np.copyto(out, src)
    if kind == "native":
        _native(g, out, op, dtype_name, route.algorithm, shape, shared[1] + 1 if shared else 0, route.auto)
        return
    parts = out if isinstance(out, list) else [out]
    count = sum(a.size for a in parts)
    word = guard.count_word(shape, count)
    extra = shared[1] + 1 if shared else 0
    code = shmsync.kernel_dtype_code(dtype_name)
    dog = watchdog()
    what = lambda algo=route.algorithm: guard.describe_header(  # noqa: E731 - built only for a stall report
        guard.make_header(g.seq, "allreduce", op, dtype_name, word, algo, extra)) + f" on {g.name}"
    if kind == "tuned":  # several algorithms qualify: local rank 0 picks at run time (tuning.py)
        _tuned_call(g, sum(a.nbytes for a in parts), op, dtype_name, code, word, route.candidates)(out, shape)
        return
    if kind == "flags" or kind == "piped":  # the agreement header rides on the (first) flag
        g.seq += 1
        header = _flag_header(g.seq, op, code, word, _SHM)
        if kind == "piped":
            g.node_flags.allreduce_piped(out, code, op, g.size, header, dog, what, g.describe_ranks, g, shape)
            return
        status = g.node_flags.ctx.exchange(header, out, code, _KERNEL_OP[op], dog.timeout)
        if status:
            _exchange_failed(g, out, op, status, dog, shape)
        return
    if _CHECKS.on:
        guard.agree(g, guard.make_header(0, "allreduce", op, dtype_name, word, route.algorithm, extra), dog, shape)
    else:
        g.seq += 1
    if kind == "zero-copy":
        algorithms.shm_zero_copy_(g, shared[0], shared[1], out.size, op, dtype_name, dog, what,
                                  cross=route.algorithm == "hierarchical", arrived=bool(g.small_shm) and _CHECKS.on)
    elif kind == "shm" or kind == "hierarchical":
        algorithms.shm_(g, src, out, op, dtype_name, dog, what, cross=kind == "hierarchical", shape=shape)
    elif kind == "local":
        finish_average(out, 1, dtype_name)
    else:  # ring (native returned above)
        algorithms.ring_(g.ring_comm, out, op, dtype_name, dog, what, describe=lambda r: g.describe_ranks([r]))


def _tuned_call(g: Group, nbytes: int, op: str, dtype_name: str, code: int, word: int,
                candidates: Tuple[str, ...]) -> "_BoundTuned":
    """The group's cached call that all-reduces ``nbytes`` (an array, or a list of arrays of
    one dtype reduced as their concatenation; ``word`` the header's count word) in place with
    the algorithm its local rank 0 (across nodes: its rank 0) picks among ``candidates``
    (``tuning.Tuner``): ``call(out, shape)``, ``shape`` the caller's, named if the check fails."""
    key = ("tuned", nbytes, op, dtype_name, word, candidates)
    call = g.routes.get(key)
    if call is None:
        kind = _TunedCall if g.topology.single_node else _TunedAcrossNodes
        call = kind(g, nbytes, op, dtype_name, code, word, candidates)
        _cache(g, key, call)
    return call


class _BoundTuned:
    """``auto``'s run-time choice for one kind of call (size, dtype, op, count word,
    candidates), its fixed facts bound once; cached on the group, run by the lean path (1-D
    arrays) and by the executor (any shape, lists of arrays).

    Why bound: between two all-reduces of a few MiB the caches hold the data just reduced,
    not the interpreter's, and each Python call costs several times what it costs warm (with
    2 ranks at 4 MiB the general path's layers around MPI_Allreduce cost ~0.1 ms, a tenth of
    the call; across nodes with more ranks than cores, more). MPI_Allreduce, often the pick,
    runs through ``_NativeCall``."""

    __slots__ = ("group", "key", "candidates", "op", "dtype_name", "word", "what", "native")

    def __init__(self, g: Group, nbytes: int, op: str, dtype_name: str, word: int,
                 candidates: Tuple[str, ...]) -> None:
        self.group, self.op, self.dtype_name, self.word = g, op, dtype_name, word
        self.key = (tuning.size_class(nbytes), candidates)
        self.candidates = candidates
        self.what = lambda algo: guard.describe_header(  # noqa: E731 - built only for a stall report
            guard.make_header(g.seq, "allreduce", op, dtype_name, word, algo, 0)) + f" on {g.name}"
        plain = "native" in candidates and dtype_name in _PLAIN_NATIVE and _NativeCall.plain(op, np.dtype(dtype_name))
        self.native = _NativeCall(g, op, dtype_name, word, "native") if plain else None

    def _run(self, algo: str, out, shape) -> None:
        """Run the pick (not the piped path) on ``out``, after the agreement check."""
        if algo == "native" and self.native is not None and type(out) is np.ndarray:
            self.native.reduce(out)
        else:
            _run_picked(self.group, algo, out, self.op, self.dtype_name, _world_state["watchdog"], self.what, shape)


class _TunedCall(_BoundTuned):
    """``_BoundTuned`` on one node.

    Local rank 0 decides for a run of calls of this size class (``Tuner.choose_run``: up to
    ``TUNED_RUN_CALLS`` of the running best; trials call by call) and sends the choice and the
    run's length in one flag exchange that is also the agreement check (a sum in which only
    local rank 0 contributes); every rank then runs the same algorithm. Within a run nothing
    is decided: the piped path carries the agreement header on its first flag (a rank that
    arrives early starts without waiting; an exchange in front of each piped call would line
    the ranks up and cost ~9 µs of pipelining at 1 MiB), another pick checks it in a flag
    exchange of its own. Local rank 0 times every call for its tuner, from before the
    exchange: its wait holds the skew the previous call (the same algorithm, unless it just
    switched, which the tuner does not believe) left between ranks, and hands the timings to
    the tuner at the next decision (``Tuner.defer``). Runs for every pick: with 2 ranks at 4 MiB
    a decision every call cost ~0.05 ms more."""

    __slots__ = ("code", "red", "deciding")

    def __init__(self, g: Group, nbytes: int, op: str, dtype_name: str, code: int, word: int,
                 candidates: Tuple[str, ...]) -> None:
        super().__init__(g, nbytes, op, dtype_name, word, candidates)
        self.code, self.red = code, _HEADER_OP[op]
        self.deciding = g.node_flags.rank == 0

    def __call__(self, out, shape=None) -> None:
        g = self.group
        g.seq += 1
        dog = _world_state["watchdog"]
        run = g.tuned_runs.get(self.key)
        start = _perf_counter()
        header = _PACK(g.seq, _ALLREDUCE, self.red, self.code, self.word, _AUTO, 0, 0) if _CHECKS.on else None
        if run is not None and run[1] > 0:  # inside a run: no decision; the piped path checks the
            run[1] -= 1                     # header on its first flag, another pick in a flag exchange
            algo = self.candidates[run[0]]
            if header is not None and algo != "shm":  # (NodeFlags.agree, inlined)
                status = g.node_flags.ctx.exchange(header, None, 0, 0, dog.timeout)
                if status:
                    g.node_flags.check(status, dog, lambda: self.what(algo), g.describe_ranks, g, shape)
                header = None
        else:
            algo = _tuned_choice(g, self.key, self.candidates, header, self.deciding, dog, self.what, shape)
            header = None  # checked in the exchange
        if algo == "shm":  # takes a list of buffers as it is
            g.node_flags.allreduce_piped(out, self.code, self.op, g.size, header, dog, lambda: self.what(algo),
                                         g.describe_ranks, g, shape)
        else:
            self._run(algo, out, shape)
        if self.deciding:  # recorded at the next decision (Tuner.defer): nothing is decided before it
            g.tuner.defer(self.key, algo, _perf_counter() - start)


class _TunedAcrossNodes(_BoundTuned):
    """``_BoundTuned`` on a group that spans nodes: group rank 0 picks every call
    (``tuning.Tuner``, timing each call from before the check to the end) and its pick rides
    on the agreement check's verdict (``DecisionCheck``), so the choice costs no message of
    its own. With the check off there is nothing to carry it: the fixed choice
    (``candidates[0]``) runs."""

    __slots__ = ("header", "check")

    def __init__(self, g: Group, nbytes: int, op: str, dtype_name: str, code: int, word: int,
                 candidates: Tuple[str, ...]) -> None:
        super().__init__(g, nbytes, op, dtype_name, word, candidates)
        self.header, self.check = g.routes.get(("decision", op, dtype_name, word)) or _tuned_check(
            g, op, dtype_name, word)

    def __call__(self, out, shape=None) -> None:
        g, candidates = self.group, self.candidates
        deciding = g.rank == 0 and _CHECKS.on
        start = _perf_counter()
        pick = 0
        if deciding:
            if g.tuner is None:
                g.tuner = tuning.Tuner()
            pick = 1 + candidates.index(g.tuner.choose(self.key, candidates))
        if not _CHECKS.on:
            g.seq += 1
            got = 1
        elif self.check is not None:
            got = self.check(pick, shape)
        else:
            got = guard.agree(g, self.header.copy(), _world_state["watchdog"], shape, decision=pick)
        if not 1 <= got <= len(candidates):
            raise CommError(f"{self.what('auto')}: rank 0 of group '{g.name}' sent choice {got} for "
                            f"{len(candidates)} candidates: the ranks disagree on the algorithms to choose from.\n"
                            "HINT: every rank must run with the same HPCTRAIN_* settings")
        algo = candidates[got - 1]
        self._run(algo, out, shape)
        if deciding:
            g.tuner.record(self.key, algo, _perf_counter() - start)


# dtypes whose MPI_Allreduce is one call of MPI's own type (float16 may need an upcast, bfloat16 does)
_PLAIN_NATIVE = frozenset(name for name in DTYPE_CODES if name not in ("float16", "bfloat16"))
_perf_counter = time.perf_counter


def _run_picked(g: Group, algo: str, out, op: str, dtype_name: str, dog, what, shape=None) -> None:
    """Run the tuner's pick (ring, hierarchical or native) on ``out`` (an array, or a list of
    arrays reduced as their concatenation), after the agreement check."""
    fused = np.concatenate(out) if isinstance(out, list) else out
    if algo == "ring":
        algorithms.ring_(g.ring_comm, fused, op, dtype_name, dog, lambda: what(algo),
                         describe=lambda r: g.describe_ranks([r]))
    elif algo == "hierarchical":
        algorithms.shm_(g, fused, fused, op, dtype_name, dog, lambda: what(algo), cross=True, shape=shape)
    else:
        with dog.watch(lambda: what(algo), _all_ranks(g)):
            algorithms.native_(g.comm, fused, op, dtype_name)
    if fused is not out:
        _scatter_back(fused, out)


def _tuned_check(g: Group, op: str, dtype_name: str, word: int) -> tuple:
    """A tuned call's header (sequence 0) and its ``DecisionCheck`` (None: ``guard.agree``),
    cached on ``g`` under ("decision", op, dtype name, count word)."""
    header = guard.make_header(0, "allreduce", op, dtype_name, word, "auto")
    entry = (header, DecisionCheck.for_group(g, header))
    _cache(g, ("decision", op, dtype_name, word), entry)
    return entry


# Longest run of calls local rank 0 commits to without an exchange (its reaction time to a
# change of the machine's state, in calls of one size class).
TUNED_RUN_CALLS = 16


def _tuned_choice(g: Group, key, candidates: Tuple[str, ...], header, deciding: bool, dog, what, shape=None) -> str:
    """The decision exchange: local rank 0's choice (and run length) to every rank, with the
    agreement check. Sets ``g.tuned_runs[key]`` to [choice, further calls of the run]."""
    flags = g.node_flags
    choice = g.tuned_choice
    if deciding:
        if g.tuner is None:
            g.tuner = tuning.Tuner()
        name, calls = g.tuner.choose_run(key, candidates, TUNED_RUN_CALLS)
        choice[0] = 1 + candidates.index(name) + _RUN_SHIFT * (min(max(calls, 1), TUNED_RUN_CALLS) - 1)
    else:
        choice[0] = 0
    status = flags.ctx.exchange(header, choice, _INT64, _SUM, dog.timeout)
    if status:
        flags.check(status, dog, lambda: what("auto") + " (agreement check)", g.describe_ranks, g, shape)
    value = int(choice[0])
    picked, further = value % _RUN_SHIFT, value // _RUN_SHIFT
    if not 1 <= picked <= len(candidates) or further >= TUNED_RUN_CALLS:
        raise CommError(f"{what('auto')}: the ranks of this node disagree on the algorithms to choose from "
                        f"(local rank 0 sent choice {value} for {len(candidates)} candidates).\n"
                        "HINT: every rank must call the same collective with the same size and dtype; "
                        "switch the agreement check on (HPCTRAIN_CHECK_COLLECTIVES=1) to see which rank differs")
    g.tuned_runs[key] = [picked - 1, further]
    return candidates[picked - 1]


_RUN_SHIFT = 64  # choice value = candidate number + _RUN_SHIFT × (calls of the run − 1)


def _exchange_failed(g: Group, x: np.ndarray, op: str, status: int, dog, shape=None) -> None:
    """Report a flag exchange of ``allreduce_`` that timed out or found the ranks disagreeing."""
    g.node_flags.check(status, dog, lambda: f"allreduce({op}, {x.dtype}, {x.size} elements, shm) "
                                            f"[collective #{g.seq}] on {g.name}", g.describe_ranks, g,
                       x.shape if shape is None else shape)


def grouped_allreduce_(xs: Sequence[Any], op: str = "sum", group: Optional[Group] = None) -> List[Any]:
    """In-place all-reduce of several numpy arrays / contiguous CPU tensors of one dtype as
    one fused collective (their concatenation); returns ``xs``.

    On one node with shared-memory flags the buffers stream through the flag slots where they
    lie (no fusion buffer to copy into and out of: how the DistributedOptimizer reduces
    gradient buckets); elsewhere they are concatenated, reduced and copied back."""
    return _grouped_allreduce_(xs, op, _sync_start(group))


def _grouped_allreduce_(xs: Sequence[Any], op: str, g: Group, shape=None) -> List[Any]:
    """``grouped_allreduce_`` on a resolved group; ``shape``: what the ranks agree on, when not
    the arrays' shapes (fused async calls add their names)."""
    check_op(op)
    flats = [flatten(x, writable=True, what="grouped_allreduce_") for x in xs]
    names = {f.dtype_name for f in flats}
    if len(names) > 1:
        raise ValueError(f"grouped_allreduce_: every array must have the same dtype, got {sorted(names)}.\n"
                         "HINT: reduce each dtype in its own call")
    name = names.pop() if names else "float32"
    arrays = [f.array for f in flats]
    if arrays:
        _check_reducible(op, name, arrays[0])
    nbytes = sum(a.nbytes for a in arrays)
    if shape is None:
        shape = guard.grouped_shape([f.shape for f in flats])
    route = None if g.joined else _route(g, nbytes, name, requested_algorithm("auto"), False)
    agreed = False
    if route is not None:
        try:
            if route.kind in ("piped", "tuned"):  # streamed (or fused by the tuned path) where they lie
                _execute(g, route, arrays, arrays, op, name, shape)
                return list(xs)
            concat = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.float32)
            _execute(g, route, concat, concat, op, name, shape)
            _scatter_back(concat, arrays)
            return list(xs)
        except CollectiveMismatchError as e:
            if not joining.ranks_joined(g, e):
                raise
            agreed = True  # ranks have joined: redo below, the joined ranks adding zeros
    # ranks have joined: over MPI, the joined ranks adding zeros (the arrays are as they were:
    # a failed agreement check comes before any data moves)
    concat = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.float32)
    joining.allreduce_(g, concat, op, name, shape, watchdog(), agreed)
    _scatter_back(concat, arrays)
    return list(xs)


def _scatter_back(fused: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    """Copy consecutive pieces of ``fused`` back into ``arrays``."""
    offset = 0
    for a in arrays:
        np.copyto(a, fused[offset:offset + a.size].reshape(a.shape))
        offset += a.size


def grouped_allreduce_async(xs: Sequence[Any], op: str = "sum", group: Optional[Group] = None) -> asyncq.Handle:
    """Start ``grouped_allreduce_`` on the background thread; ``handle.wait()`` returns ``xs``."""
    g = resolve(group)
    check_op(op)
    for x in xs:
        flatten(x, writable=True, what="grouped_allreduce_async")  # fail here, in the caller's thread
    return asyncq.submit(f"grouped_allreduce_async({op})", lambda: grouped_allreduce_(xs, op, g))


def shared_buffer(shape, dtype="float32", group: Optional[Group] = None) -> algorithms.SharedBuffer:
    """Allocate a buffer in the node's shared window (same shape and dtype on every rank of
    ``group``; every rank calls this). All-reduces on it, or on contiguous views into it, run
    zero-copy. ``dtype`` may be a numpy dtype name or "bfloat16"."""
    g = _sync_start(group)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    count = int(np.prod(shape, dtype=np.int64))
    dtype_name = str(dtype).replace("torch.", "")
    np_dtype = np.uint16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    dog = watchdog()
    header = guard.make_header(0, "allreduce", "-", dtype_name, guard.count_word(shape, count), "shm", 0)
    guard.agree(g, header, dog, shape)
    with dog.watch(f"shared_buffer({shape}, {dtype_name}) allocation on {g.name}", _all_ranks(g)):
        sbuf = algorithms.SharedBuffer(g, count, np_dtype, dtype_name)
    sbuf.array = sbuf.array.reshape(shape)
    g.shared_buffers.append(sbuf)
    return sbuf


def free_shared_buffer(sbuf: algorithms.SharedBuffer) -> None:
    """Release a shared buffer (collective over its node); its views become invalid."""
    if sbuf in sbuf.group.shared_buffers:
        sbuf.group.shared_buffers.remove(sbuf)
    sbuf.free()


def _find_shared(g: Group, arr: np.ndarray):
    if arr.base is None:  # owns its memory (numpy allocated it): not in a window; ~1 µs saved per small call
        return None
    for sbuf in g.shared_buffers:
        offset = sbuf.locate(arr)
        if offset is not None:
            return sbuf, offset
    return None


# --------------------------------------------------------------------------- gather / scatter
def _refused_while_joined(fn):
    """Collectives other than all-reduces raise JoinedRanksError while ranks have joined."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CollectiveMismatchError as e:
            raise joining.refusal(e, fn.__name__)
    return call


def _rows(flat: Flat) -> Tuple[int, tuple]:
    shape = flat.shape or (1,)
    return shape[0], tuple(shape[1:])


@_refused_while_joined
def allgather(x: Any, group: Optional[Group] = None) -> Any:
    """Concatenate every rank's ``x`` along dimension 0 (dimension 0 may differ per rank;
    the other dimensions and the dtype must agree)."""
    g = _sync_start(group)
    if device.on_device(x):
        return device.allgather(g, x)
    flat = flatten(x, what="allgather")
    rows, rest = _rows(flat)
    dog = watchdog()
    header = guard.make_header(0, "allgather", "-", flat.dtype_name, -1, "-", guard.shape_code(rest))
    guard.agree(g, header, dog)
    row_bytes = int(np.prod(rest, dtype=np.int64)) * flat.array.itemsize
    counts = np.empty(g.size, dtype=np.int64)
    with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
        g.comm.Allgather(np.array([rows], dtype=np.int64), counts)
        byte_counts = counts * row_bytes
        displs = np.concatenate([[0], np.cumsum(byte_counts)[:-1]])
        out = np.empty(int(byte_counts.sum()) // max(flat.array.itemsize, 1), dtype=flat.array.dtype)
        g.comm.Allgatherv(flat.array.view(np.uint8), [out.view(np.uint8), (byte_counts, displs), MPI.BYTE])
    return rebuild(flat, out, (int(counts.sum()), *rest))


@_refused_while_joined
def broadcast(x: Any, root: int = 0, group: Optional[Group] = None) -> Any:
    """Return a copy of root's ``x`` on every rank (every rank passes the same shape)."""
    g = _sync_start(group)
    if device.on_device(x):
        _check_root(root, g)
        return device.broadcast_(g, x.detach().clone(), root)
    flat = flatten(x, what="broadcast")
    out = flat.array.copy()
    _broadcast_flat(g, flat, out, root)
    return rebuild(flat, out)


@_refused_while_joined
def broadcast_(x: Any, root: int = 0, group: Optional[Group] = None) -> Any:
    """Overwrite ``x`` with root's ``x`` on every rank; returns ``x``."""
    g = _sync_start(group)
    if device.on_device(x):
        _check_root(root, g)
        return device.broadcast_(g, x, root)
    flat = flatten(x, writable=True, what="broadcast_")
    _broadcast_flat(g, flat, flat.array, root)
    return x


def _broadcast_flat(g: Group, flat: Flat, out: np.ndarray, root: int) -> None:
    _check_root(root, g)
    dog = watchdog()
    header = guard.make_header(0, "broadcast", "-", flat.dtype_name, guard.count_word(flat.shape, flat.array.size),
                               "-", root + 1)
    guard.agree(g, header, dog, flat.shape)
    if g.size > 1 and out.size:
        with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
            g.comm.Bcast(out.view(np.uint8), root=root)


@_refused_while_joined
def reduce_scatter(x: Any, op: str = "sum", group: Optional[Group] = None) -> Any:
    """Reduce ``x`` over ranks and return this rank's rows of dimension 0 (rows split as
    evenly as possible, the first ranks getting one more)."""
    g = _sync_start(group)
    check_op(op)
    if device.on_device(x):
        return device.reduce_scatter(g, x, op)
    flat = flatten(x, what="reduce_scatter")
    rows, rest = _rows(flat)
    row_elems = int(np.prod(rest, dtype=np.int64))
    bounds = plan.chunk_bounds(rows, g.size)
    a, b = bounds[g.rank]
    dog = watchdog()
    header = guard.make_header(0, "reduce_scatter", op, flat.dtype_name, guard.count_word(flat.shape, flat.array.size))
    guard.agree(g, header, dog, flat.shape)
    counts = [(hi - lo) * row_elems for lo, hi in bounds]
    out = np.empty(counts[g.rank], dtype=flat.array.dtype)
    with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
        # float min/max through native_ too, which propagates NaN as every all-reduce does
        if (flat.dtype_name in ("bfloat16", "bool") or g.size == 1
                or op in ("min", "max") and flat.array.dtype.kind == "f"):
            full = flat.array.copy()
            if g.size > 1:
                algorithms.native_(g.comm, full, op, flat.dtype_name)
            np.copyto(out, full[a * row_elems:b * row_elems])
        else:
            g.comm.Reduce_scatter(flat.array, out, recvcounts=counts, op=algorithms._mpi_op(op, flat.dtype_name))
            if op == "avg":
                finish_average(out, g.size, flat.dtype_name)
    return rebuild(flat, out, (b - a, *rest))


@_refused_while_joined
def alltoall(x: Any, splits: Optional[Sequence[int]] = None, group: Optional[Group] = None) -> Tuple[Any, np.ndarray]:
    """Send rows ``splits[i]`` of ``x`` (dimension 0, in order) to rank i; return the rows
    received (concatenated in rank order) and how many came from each rank."""
    g = _sync_start(group)
    if device.on_device(x):
        return device.alltoall(g, x, splits)
    flat = flatten(x, what="alltoall")
    rows, rest = _rows(flat)
    splits = plan.alltoall_splits(rows, g.size, splits)
    dog = watchdog()
    header = guard.make_header(0, "alltoall", "-", flat.dtype_name, -1, "-", guard.shape_code(rest))
    guard.agree(g, header, dog)
    row_bytes = int(np.prod(rest, dtype=np.int64)) * flat.array.itemsize
    recv_splits = np.empty(g.size, dtype=np.int64)
    with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
        g.comm.Alltoall(splits, recv_splits)
        sc, rc = splits * row_bytes, recv_splits * row_bytes
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
        out = np.empty(int(rc.sum()) // max(flat.array.itemsize, 1), dtype=flat.array.dtype)
        g.comm.Alltoallv([flat.array.view(np.uint8), (sc, sd), MPI.BYTE], [out.view(np.uint8), (rc, rd), MPI.BYTE])
    return rebuild(flat, out, (int(recv_splits.sum()), *rest)), recv_splits


# --------------------------------------------------------------------------- objects, barrier
@_refused_while_joined
def broadcast_object(obj: Any, root: int = 0, group: Optional[Group] = None) -> Any:
    """Root's picklable ``obj`` on every rank."""
    g = _sync_start(group)
    _check_root(root, g)
    dog = watchdog()
    header = guard.make_header(0, "broadcast_object", extra=root + 1)
    guard.agree(g, header, dog)
    with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
        return g.comm.bcast(obj, root=root)


@_refused_while_joined
def allgather_object(obj: Any, group: Optional[Group] = None) -> List[Any]:
    """Every rank's picklable ``obj``, as a list in rank order."""
    g = _sync_start(group)
    dog = watchdog()
    header = guard.make_header(0, "allgather_object")
    guard.agree(g, header, dog)
    with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
        return g.comm.allgather(obj)


@_refused_while_joined
def barrier(group: Optional[Group] = None) -> None:
    """Wait until every rank of ``group`` arrives."""
    g = _sync_start(group)
    dog = watchdog()
    header = guard.make_header(0, "barrier")
    guard.agree(g, header, dog)
    with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
        g.comm.Barrier()


def join(group: Optional[Group] = None) -> int:
    """Horovod's join: until every rank of ``group`` has called it, take part in the other
    ranks' all-reduces with zeros (``joining.py``); return the group rank that joined last."""
    g = _sync_start(group)
    return joining.join(g, watchdog())


def refuse(group: Optional[Group] = None) -> None:
    """Stand for a call this rank refused (its arguments were wrong): enter the collective the
    other ranks of ``group`` are in with an ``invalid_call`` header, so that their agreement
    check fails (CollectiveMismatchError naming this rank) and nobody waits for a collective
    this rank will not run. The caller then raises its own error. Without the agreement check
    (HPCTRAIN_CHECK_COLLECTIVES=0) this does nothing."""
    g = _sync_start(group)
    if g.size == 1 or not guard.checks_enabled():
        return
    try:
        guard.agree(g, guard.make_header(0, "invalid_call"), watchdog())
    except CollectiveMismatchError:
        pass  # the expected outcome: the others' call failed as well


# --------------------------------------------------------------------------- point to point
def send(x: Any, dest: int, tag: int = 0, group: Optional[Group] = None) -> None:
    """Send ``x`` to ``dest`` (a rank of ``group``); the receiver calls ``recv``."""
    g = resolve(group)
    _check_root(dest, g, "dest")
    flat = flatten(x, what="send")
    with watchdog().watch(f"send of {flat.array.nbytes} bytes to {g.describe_ranks([dest])} (tag {tag})",
                          lambda: g.describe_ranks([dest])):
        g.p2p_comm.Send(flat.array.view(np.uint8), dest=dest, tag=tag)


def recv(out: Any, source: int, tag: int = 0, group: Optional[Group] = None) -> Any:
    """Receive into ``out`` (shape and dtype agreed with the sender); returns ``out``."""
    g = resolve(group)
    _check_root(source, g, "source")
    flat = flatten(out, writable=True, what="recv")
    status = MPI.Status()
    with watchdog().watch(f"recv of {flat.array.nbytes} bytes from {g.describe_ranks([source])} (tag {tag})",
                          lambda: g.describe_ranks([source])):
        g.p2p_comm.Probe(source=source, tag=tag, status=status)
        got = status.Get_count(MPI.BYTE)
        if got != flat.array.nbytes:
            raise CommError(
                f"recv from {g.describe_ranks([source])} (tag {tag}): message has {got} bytes, the buffer "
                f"{flat.array.nbytes} ({flat.shape}, {flat.dtype_name}). HINT: sender and receiver must agree "
                "on shape and dtype."
            )
        g.p2p_comm.Recv(flat.array.view(np.uint8), source=source, tag=tag)
    return out


def send_object(obj: Any, dest: int, tag: int = 0, group: Optional[Group] = None) -> None:
    g = resolve(group)
    _check_root(dest, g, "dest")
    with watchdog().watch(f"send_object to {g.describe_ranks([dest])}", lambda: g.describe_ranks([dest])):
        g.p2p_comm.send(obj, dest=dest, tag=tag)


def recv_object(source: int, tag: int = 0, group: Optional[Group] = None) -> Any:
    g = resolve(group)
    _check_root(source, g, "source")
    with watchdog().watch(f"recv_object from {g.describe_ranks([source])}", lambda: g.describe_ranks([source])):
        return g.p2p_comm.recv(source=source, tag=tag)


def _check_root(root: int, g: Group, what: str = "root") -> None:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < g.size:
        raise ValueError(f"{what} must be a rank of group '{g.name}' (0…{g.size - 1}), got {root!r}")
