"""Horovod's collective operations on torch tensors, on top of :mod:`hpctrain.comm`.

Names, arguments and results follow ``horovod.torch`` (docs/api.rst): ``allreduce`` returns a
new tensor, ``allreduce_`` works in place, ``*_async`` return a handle for ``synchronize`` /
``poll``. Differences, all documented in docs/torch.md:

- collectives are matched by submission order (every rank must issue the same collectives in
  the same order), not by ``name=``; an explicit name is part of what the ranks of an
  all-reduce or an ``*_async`` call agree on, so calls issued in different orders raise on
  every rank.
- ``op=Adasum`` runs Horovod's CPU Adasum over MPI (``adasum.py``) for every tensor's device.
- ``init(comm=...)`` accepts only a communicator (or list of ranks) spanning every rank.
- ``join()`` needs the agreement check (on by default); with HPCTRAIN_CHECK_COLLECTIVES=0
  it is a collective every rank calls.

Gradients, integer scaling, ``root_rank`` (a global rank) and argument errors follow
Horovod 0.28; tests/mpi/test_horovod_conformance.py checks each.
"""
from __future__ import annotations

import enum
import functools
import inspect
import itertools
import os
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch

from hpctrain import comm
from hpctrain import comm as _comm  # for init(), whose argument is called comm as in Horovod

from . import agreement, staging, timeline
from .compression import Compression
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt, HpctrainNotInitialized, require_init
from . import process_sets as _sets
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .process_sets import group_of as _group, size_of as _group_size
from hpctrain.comm import asyncq
from hpctrain.comm.collectives import allreduce_now
from hpctrain.comm.errors import CollectiveMismatchError
from hpctrain.comm.guard import named_shape

__all__ = [
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "HpctrainNotInitialized", "Handle", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "mpi_threads_supported", "start_timeline", "stop_timeline",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "sparse_allreduce_async", "HorovodInternalError", "HostsUpdatedInterrupt",
    "synchronize", "poll", "join", "barrier",
]


class ReduceOp(enum.IntEnum):
    """Reduction operations, numbered as in Horovod."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product

_COMM_OPS = {ReduceOp.Average: "avg", ReduceOp.Sum: "sum", ReduceOp.Min: "min",
             ReduceOp.Max: "max", ReduceOp.Product: "prod"}


_require_init = require_init


# --------------------------------------------------------------------------- basics
def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None) -> None:  # noqa: F811
    """Start MPI (idempotent; a second call keeps what is registered). ``process_sets``: a list
    of ``ProcessSet`` (ranks, or an mpi4py communicator per rank) to register now, collectively
    and as in Horovod (a set listed twice, or the world's ranks, is a ValueError), or "dynamic".

    Also raises glibc's malloc thresholds in this process, as ``hpctrain launch`` does for
    the ranks it starts (unless MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ are set or
    HPCTRAIN_MALLOC_TUNING=0): a script started by plain ``mpiexec``/``srun`` would otherwise
    fault its freed gradient blocks back in every step (measured: 4,080 faults per step,
    ~8 ms at ~2 us each, for the 10.5M-parameter MLP at 2 ranks)."""
    from hpctrain.malloc_tuning import tune_this_process

    tune_this_process()
    _comm.init()
    if comm is not None:
        _check_init_comm(comm)
    _sets.start(comm)
    _sets.register_at_init(process_sets)
    _timeline_from_env()


def _timeline_from_env() -> None:
    """Horovod's HOROVOD_TIMELINE=<file> (rank 0 writes it from init on; DYNAMIC: only by
    start_timeline) and HOROVOD_TIMELINE_MARK_CYCLES=1."""
    path = os.environ.get("HOROVOD_TIMELINE", "")
    if path and path.upper() != "DYNAMIC" and comm.rank() == 0 and not timeline.active():
        marks = os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "").strip().lower() in ("1", "true", "yes", "on")
        timeline.start(path, marks)


def _check_init_comm(communicator: Any) -> None:
    """Accept Horovod's ``init(comm=...)`` forms that name every rank in world order: a list of
    ranks, or an mpi4py communicator congruent with MPI_COMM_WORLD. Sub-communicators are
    refused on every rank (they would need a world smaller than the MPI job)."""
    world, me = comm.size(), comm.rank()
    if isinstance(communicator, (list, tuple, range)):
        ranks = [int(r) for r in communicator]
        ok = ranks == list(range(world))
        what = f"comm={ranks}"
    elif hasattr(communicator, "Get_size") and hasattr(communicator, "allgather"):
        ok = all(communicator.allgather(communicator.Get_size() == world and communicator.Get_rank() == me))
        what = f"comm=<communicator of {communicator.Get_size()} ranks>"
    else:
        raise ValueError(f"hvd.init(comm={type(communicator).__name__}): expected a list of rank integers or an "
                         "mpi4py.MPI.Comm object")
    if not ok:
        raise NotImplementedError(
            f"hvd.init({what}): hpctrain runs on every rank of the MPI job in world order; a subset of ranks is "
            f"not supported.\nHINT: call hvd.init() and use hvd.add_process_set(ranks) for collectives over a "
            "subset of ranks")


def shutdown() -> None:
    """Wait for pending collectives and release hpctrain's communicators."""
    from . import backends

    backends.shutdown_backends()
    timeline.stop()
    _sets.shutdown()
    comm.shutdown()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return comm.is_initialized()


def rank() -> int:
    """This process's rank in the world (0 .. size-1)."""
    _require_init("hvd.rank()")
    return comm.rank()


def size() -> int:
    """Number of processes."""
    _require_init("hvd.size()")
    return comm.size()


def local_rank() -> int:
    """Rank among the processes on this node."""
    _require_init("hvd.local_rank()")
    return comm.local_rank()


def local_size() -> int:
    """Number of processes on this node."""
    _require_init("hvd.local_size()")
    return comm.local_size()


def cross_rank() -> int:
    """Index of this node among the nodes."""
    _require_init("hvd.cross_rank()")
    return comm.cross_rank()


def cross_size() -> int:
    """Number of nodes."""
    _require_init("hvd.cross_size()")
    return comm.cross_size()


def is_homogeneous() -> bool:
    """True when every node runs the same number of processes."""
    _require_init("hvd.is_homogeneous()")
    sizes = comm.allgather_object(comm.local_size())
    return len(set(sizes)) == 1


def mpi_enabled() -> bool:
    """True: hpctrain always communicates through MPI."""
    return True


def mpi_built() -> bool:
    """True: hpctrain is built on MPI (mpi4py)."""
    return True


def gloo_built() -> bool:
    """True when torch.distributed has Gloo (usable with ``backend="gloo"``)."""
    return bool(torch.distributed.is_available() and torch.distributed.is_gloo_available())


def gloo_enabled() -> bool:
    """Same as :func:`gloo_built`: Gloo is bootstrapped on demand through MPI."""
    return gloo_built()


def nccl_built() -> bool:
    """True when torch.distributed has NCCL (usable with ``backend="nccl"``)."""
    return bool(torch.distributed.is_available() and torch.distributed.is_nccl_available())


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not supported."""
    return False


def cuda_built() -> bool:
    """True when PyTorch has CUDA; CUDA tensors are staged through host memory unless MPI is CUDA-aware."""
    return torch.cuda.is_available()


def rocm_built() -> bool:
    """False."""
    return False


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE."""
    _require_init("hvd.mpi_threads_supported()")
    return bool(comm.mpi_threads_supported())


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write a Chrome trace of this job's collectives to ``file_path`` (rank 0 writes it, as in
    Horovod): one trace row per tensor name, one span per operation. ``mark_cycles``: a
    CYCLE_START marker opens each operation. The
    environment can start it at ``init()`` instead: HOROVOD_TIMELINE, HOROVOD_TIMELINE_MARK_CYCLES."""
    _require_init("hvd.start_timeline")
    if comm.rank() == 0:
        timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline started by :func:`start_timeline` and close its file."""
    _require_init("hvd.stop_timeline")
    timeline.stop()


_trace_depth = threading.local()
_trace_counter = itertools.count()


def _traced(op_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Record the outermost public collective call on the timeline (no cost while none is
    being written). An asynchronous call's span ends when its handle is synchronized."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if not timeline.active() or getattr(_trace_depth, "n", 0):
                return fn(*args, **kwargs)
            # Horovod's row names: "<op>.<name>", "<op>.noname.<counter>" without a name.
            given = signature.bind_partial(*args, **kwargs).arguments.get("name")
            name = f"{op_name.lower()}.{given}" if given else f"{op_name.lower()}.noname.{next(_trace_counter)}"
            t0 = time.time()
            _trace_depth.n = 1
            try:
                result = fn(*args, **kwargs)
            finally:
                _trace_depth.n = 0
            if isinstance(result, Handle) and not result._finished:
                result._trace = (name, op_name, t0)
            else:
                timeline.record(name, op_name, t0, time.time())
            return result
        return traced
    return wrap


# --------------------------------------------------------------------------- handles
class Handle:
    """Handle of an asynchronous operation: pass it to :func:`synchronize` or :func:`poll`."""

    __slots__ = ("_inner", "_finish", "_result", "_finished", "name", "_pending_name", "_trace", "_cleared")

    def __init__(self, inner: Any = None, finish: Optional[Callable[[Any], Any]] = None,
                 result: Any = None, name: str = "") -> None:
        self._inner = inner
        self._finish = finish
        self._result = result
        self._finished = inner is None and finish is None
        self.name = name
        self._pending_name: Optional[str] = None
        self._trace: Optional[Tuple[str, str, float]] = None
        self._cleared = False  # synchronize() returned its result: poll() refuses it, as Horovod does

    def done(self) -> bool:
        """True when the operation has completed (``synchronize`` will not block)."""
        return self._finished or self._inner is None or self._inner.done()

    def wait(self) -> Any:
        """Block until the operation is done; return its result."""
        if not self._finished:
            _waited["through"] = max(_waited["through"], getattr(self._inner, "seq", 0))  # FIFO: all before it too
            try:
                raw = self._inner.wait() if self._inner is not None else None
                self._result = self._finish(raw) if self._finish is not None else raw
            except CollectiveMismatchError as e:
                # Every rank of the collective gets this (the comm layer's verdict is shared).
                raise _Mismatch(str(e)) from e
            finally:
                self._finished = True
                self._inner = None
                _pending_names.discard(self._pending_name)
                if self._trace is not None:
                    timeline.record(*self._trace, time.time())
        return self._result

    def __del__(self) -> None:
        """Dropped before ``synchronize``: the name is freed once this rank has waited past the
        operation (see ``_refuse_pending``), at once when it ran in the caller's thread."""
        try:
            name = self._pending_name
            if name and not self._finished and name in _pending_names:
                seq = getattr(self._inner, "seq", None)
                if seq is None:
                    _pending_names.discard(name)
                else:
                    _orphans[name] = seq
        except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter shutdown)
            pass


class _Mismatch(HorovodInternalError, CollectiveMismatchError):
    """A mismatch found by the comm layer, raised as Horovod's type; still a ``comm.CommError``."""


_pending_names: set = set()
# Names whose handle was dropped unsynchronized -> that operation's place in submission order.
_orphans: dict = {}
# The highest submission number this rank has waited for (synchronize: that job and all before).
_waited = {"through": 0}


def _refused_everywhere(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An all-reduce call whose arguments this rank refuses (ValueError, TypeError,
    NotImplementedError before its collective ran) tells the set's other ranks through their
    agreement check (``comm.refuse``): their call raises HorovodInternalError naming this rank
    instead of waiting for it, and the next collective works, as in Horovod. A call refused on
    every rank costs one agreement check. Nothing is added to a call that succeeds."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError, NotImplementedError) as err:
            if not getattr(err, "_hpctrain_refused", False) and comm.is_initialized():
                err._hpctrain_refused = True  # type: ignore[attr-defined] - an outer call must not refuse again
                ps = signature.bind_partial(*args, **kwargs).arguments.get("process_set") or global_process_set
                if ps.included() and ps._registered:
                    comm.refuse(ps._resolve())
            raise
    return call


def _named(name: Optional[str], start: Callable[[], Handle]) -> Handle:
    """Horovod refuses an operation under a name that is still pending. Here a name is pending
    from submission until its handle is synchronized, or, for a handle dropped unsynchronized,
    until this rank next waits past its operation (a blocking collective, or ``synchronize``
    of a later handle). Both are the same point of the program on every rank (same calls in
    the same order), so every rank raises alike and nothing is submitted. (Horovod frees a name
    when its operation completes, a moment that differs between ranks: a tight loop of
    duplicates then refuses on some ranks only and leaves the others' calls waiting.)"""
    _refuse_pending(name)
    return _hold_name(start(), name)


def _refuse_pending(name: Optional[str]) -> None:
    if not name or name not in _pending_names:
        return
    dropped = _orphans.get(name)
    if dropped is not None and dropped <= max(asyncq.drained_through(), _waited["through"]):
        del _orphans[name]
        _pending_names.discard(name)
        return
    raise ValueError(f"Requested to collective on a tensor named {name!r} that is still pending.\n"
                     "HINT: synchronize() the earlier handle first, or give each operation its own name")


def _hold_name(handle: Handle, name: Optional[str]) -> Handle:
    """``name`` is pending until ``handle`` is synchronized."""
    if name:
        _pending_names.add(name)
        handle._pending_name = name
    return handle


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous operation and return its output tensor."""
    if not isinstance(handle, Handle):
        raise ValueError(f"synchronize() expects a handle returned by an *_async function, got {type(handle).__name__}")
    try:
        return handle.wait()
    finally:
        handle._cleared = True


def poll(handle: Handle) -> bool:
    """True when the asynchronous operation behind ``handle`` has finished."""
    if not isinstance(handle, Handle):
        raise ValueError(f"poll() expects a handle returned by an *_async function, got {type(handle).__name__}")
    if handle._cleared:
        raise ValueError(f"Handle {handle.name or id(handle)} was not created or has been cleared.\n"
                         "HINT: poll() a handle before synchronize(handle), which releases it")
    return handle.done()


# --------------------------------------------------------------------------- allreduce
def _resolve_op(average: Optional[bool], op: Optional[int]) -> ReduceOp:
    if average is not None:
        if op is not None:
            raise ValueError("give either op= or the deprecated average=, not both")
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return ReduceOp.Average
    try:
        op = ReduceOp(int(op))
    except ValueError:
        raise ValueError(f"unknown reduction op {op!r}; expected one of hvd.Average, Sum, Adasum, Min, Max, "
                         "Product") from None
    return op


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError(f"{what}: sparse tensors are not supported here; "
                         "HINT: call .to_dense() first, or use DistributedOptimizer(sparse_as_dense=True)")
    return tensor


# Horovod's allreduce has kernels for these integer types, float16/32/64 only; a uint8, int8,
# int16 or bool tensor is refused before anything is sent (bfloat16 and complex stay allowed).
_UNREDUCIBLE = {torch.uint8: "torch.ByteTensor", torch.int8: "torch.CharTensor", torch.int16: "torch.ShortTensor",
                torch.bool: "torch.BoolTensor"}


def _check_reducible(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype in _UNREDUCIBLE:
        raise ValueError(f"Tensor type {_UNREDUCIBLE[tensor.dtype]} is not supported.\n"
                         "HINT: all-reduce int32, int64 or floating-point tensors (e.g. tensor.int() first)")
    return tensor


def _require_dims(tensor: torch.Tensor, what: str) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{what} does not support scalar inputs; HINT: pass a tensor with at least one "
                         "dimension (it works on rows of dim 0)")


def _op_field(op: Any) -> Any:
    """The requested reduction op as ranks compare it (None is the default, Average)."""
    return int(ReduceOp.Average) if op is None else (int(op) if isinstance(op, int) else repr(op))


def _negotiate(kind: str, tensors: Sequence[torch.Tensor], process_set: Optional[ProcessSet],
               check: Callable[[], Any], **fields: Any) -> Any:
    """Run the local argument check ``check``, then agree with the set's ranks on the call
    (one small object allgather): when any rank's check failed or the calls differ, every rank
    raises (its own ValueError where its arguments were wrong, HorovodInternalError on the
    others) and none enters the collective, so the next collective works. Returns ``check()``."""
    ps = process_set or global_process_set
    group = ps._resolve()  # a non-member raises here, alone: the members do not expect it
    err: Optional[Exception] = None
    result = None
    try:
        result = check()
    except (ValueError, TypeError, NotImplementedError) as e:
        err = e
    if ps.size() > 1:
        desc = agreement.describe(kind, tensors, **fields)
        try:
            calls = comm.allgather_object((desc, None if err is None else f"{type(err).__name__}: {err}"),
                                          group=group)
        except CollectiveMismatchError as e:  # e.g. ranks have joined (hvd.join)
            raise _Mismatch(f"{kind}: {e}") from e
        outcome = agreement.verdict(kind, calls, ps.rank())
        if outcome is not None and outcome[0] == "internal":
            raise HorovodInternalError(outcome[1])
    if err is not None:
        raise err
    return result


def _submit(kind: str, tensors: Sequence[torch.Tensor], process_set: Optional[ProcessSet],
            check: Callable[[], Any], run: Callable[[Any], Any], name: str, pending: Optional[str] = None,
            **fields: Any) -> Handle:
    """Run a collective in the background (hpctrain.comm's queue, in submission order) and
    return its handle at once. A local argument error (``pending``, the caller's ``name=``,
    still pending among them) is agreed on right here (so the other ranks' background
    agreement fails too) and raised now, as Horovod raises at enqueue; a mismatch between
    ranks is raised by ``synchronize``."""
    (process_set or global_process_set)._resolve()
    local_check = check
    if pending:
        def local_check() -> Any:
            _refuse_pending(pending)
            return check()
    try:
        checked = local_check()
    except (ValueError, TypeError, NotImplementedError):
        _negotiate(kind, tensors, process_set, local_check, name=name, **fields)
        raise

    def job() -> Any:  # the name is compared too: calls matched out of order raise on every rank
        _negotiate(kind, tensors, process_set, lambda: checked, name=name, **fields)
        return run(checked)

    return _hold_name(Handle(asyncq.submit(name, job), None, name=name), pending)


def _is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _scale_(buf: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``buf`` by ``factor`` in place. Integer tensors are scaled as Horovod's
    ScaleBuffer does: in double precision, then truncated toward zero to the tensor's dtype."""
    if factor != 1.0:
        if _is_float(buf):
            buf.mul_(factor)
        else:
            buf.copy_((buf.double() * factor).to(buf.dtype))
    return buf


def _allreduce_start(tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                     compression: Any, process_set: Optional[ProcessSet], out: Optional[torch.Tensor],
                     name: str, agree_name: Optional[str] = None, fusable: bool = False,
                     blocking: bool = False) -> Handle:
    """Start an all-reduce of ``tensor``; the handle's result is ``out`` (filled) or a new tensor.
    ``agree_name``: the caller's ``name=``, which the ranks' agreement check compares too (so
    calls matched out of order by name raise on every rank instead of mixing tensors).
    ``fusable``: the ``*_async`` calls: fused with the async all-reduces queued behind it.
    ``blocking``: the caller waits at once (``hvd.allreduce``, gradients): the collective runs
    in its thread, after the queued async ones, instead of on the background thread."""
    if op == ReduceOp.Adasum:
        from . import adasum

        return adasum.start([tensor], prescale, postscale, compression, process_set,
                            None if out is None else [out], name, single=True)
    group = _group(process_set)
    n = _group_size(process_set)
    host, restore = staging.to_host(tensor)
    wire, ctx = compression.compress(host)
    # The wire buffer is always ours to overwrite: a fresh contiguous copy unless compression
    # already made a new tensor.
    if wire is not host:
        buf = wire.contiguous()
    elif out is not None and host.is_contiguous() and host.data_ptr() == out.data_ptr():
        buf = host  # in place on the caller's CPU tensor: no copy at all
    else:
        buf = host.contiguous().clone()
    # Horovod averages by summing and scaling by postscale/size; integer tensors take that path
    # too, so their average truncates exactly as Horovod's does.
    by_scaling = op == ReduceOp.Average and (prescale != 1.0 or postscale != 1.0 or not _is_float(buf))
    _scale_(buf, prescale)
    comm_op = "sum" if by_scaling else _COMM_OPS[op]
    agree_on = None if agree_name is None else named_shape(agree_name, tensor.shape)
    if blocking:
        inner = allreduce_now(buf, op=comm_op, group=group, inplace=True, agree_on=agree_on)
    else:
        inner = comm.allreduce_async(buf, op=comm_op, group=group, inplace=True, fusable=fusable, agree_on=agree_on)

    def finish(_: Any) -> torch.Tensor:
        _scale_(buf, postscale / n if by_scaling else postscale)
        result = restore(compression.decompress(buf, ctx))
        if out is not None:
            if result.data_ptr() != out.data_ptr():
                with torch.no_grad():
                    out.copy_(result.view_as(out))
            return out
        return result.view(tensor.shape)

    return Handle(inner, finish, name=name)


class _AllreduceFn(torch.autograd.Function):
    """Horovod's HorovodAllreduce: the gradient is all-reduced with the forward's op and scale
    factors, over the same process set."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, process_set, name):  # type: ignore[override]
        ctx.args = (op, prescale, postscale, process_set)
        return _allreduce_start(tensor.detach(), op, prescale, postscale, Compression.none, process_set, None,
                                name, blocking=True).wait()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        op, prescale, postscale, process_set = ctx.args
        g = _allreduce_start(grad.contiguous(), op, prescale, postscale, Compression.none, process_set,
                             None, "allreduce.grad", blocking=True).wait()
        return g, None, None, None, None, None


def _wants_grad(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


@_traced("ALLREDUCE")
@_refused_everywhere
def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return the result as a new tensor (differentiable).

    ``op``: Average (default), Sum, Min, Max, Product. ``prescale_factor`` multiplies the input
    before the reduction, ``postscale_factor`` the result after it. ``compression`` changes the
    dtype on the wire (``Compression.fp16`` / ``.bf16``).
    """
    _require_init("hvd.allreduce")
    _check_reducible(_check_tensor(tensor, "allreduce"))
    op = _resolve_op(average, op)
    if _wants_grad([tensor]):
        # Compression outside the autograd function, as Horovod does: the cast is differentiable.
        wire, cctx = compression.compress(tensor)
        out = _AllreduceFn.apply(wire, op, prescale_factor, postscale_factor, process_set, name or "allreduce")
        return compression.decompress(out, cctx)
    return _allreduce_start(tensor, op, prescale_factor, postscale_factor, compression, process_set,
                            None, name or "allreduce", name, blocking=True).wait()


@_traced("ALLREDUCE")
@_refused_everywhere
def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set,
                    compression: Any = Compression.none) -> Handle:
    """Start :func:`allreduce`; ``synchronize(handle)`` returns the new tensor."""
    _require_init("hvd.allreduce_async")
    _check_reducible(_check_tensor(tensor, "allreduce_async"))
    op = _resolve_op(average, op)
    return _named(name, lambda: _allreduce_start(tensor.detach(), op, prescale_factor, postscale_factor,
                                                 compression, process_set, None, name or "allreduce", name,
                                                 fusable=True))


@_traced("ALLREDUCE")
@_refused_everywhere
def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce`: ``tensor`` holds the result; returns it."""
    return synchronize(_allreduce_inplace_start(tensor, average, name, op, prescale_factor, postscale_factor,
                                                process_set, "allreduce_", blocking=True))


@_traced("ALLREDUCE")
@_refused_everywhere
def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place all-reduce; ``synchronize(handle)`` returns ``tensor`` holding the result."""
    return _allreduce_inplace_start(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                                    "allreduce_async_", blocking=False)


def _allreduce_inplace_start(tensor: torch.Tensor, average: Optional[bool], name: Optional[str], op: Optional[int],
                             prescale: float, postscale: float, process_set: ProcessSet, what: str,
                             blocking: bool) -> Handle:
    """``allreduce_`` (``blocking``) and ``allreduce_async_``; only the async one is fused with
    its neighbours (a blocking call has nothing queued behind it to fuse with)."""
    _require_init(f"hvd.{what}")
    _check_reducible(_check_tensor(tensor, what))
    op = _resolve_op(average, op)
    return _named(name, lambda: _allreduce_start(tensor.detach(), op, prescale, postscale, Compression.none,
                                                 process_set, tensor, name or "allreduce_", name,
                                                 fusable=not blocking, blocking=blocking))


def _grouped_start(tensors: Sequence[torch.Tensor], op: ReduceOp, prescale: float, postscale: float,
                   compression: Any, process_set: Optional[ProcessSet], inplace: bool, name: str,
                   agree_name: Optional[str] = None) -> Handle:
    tensors = [_check_reducible(_check_tensor(t, "grouped_allreduce")) for t in tensors]
    if op == ReduceOp.Adasum:  # one exchange, each tensor with its own coefficients (Horovod's fused Adasum)
        from . import adasum

        return adasum.start(tensors, prescale, postscale, compression, process_set, tensors if inplace else None,
                            name)
    # One fused buffer per dtype, in first-seen order (identical on every rank for identical input).
    order: List[torch.dtype] = []
    for t in tensors:
        if t.dtype not in order:
            order.append(t.dtype)
    parts = []
    for dtype in order:
        members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in members])
        parts.append((members, _allreduce_start(flat, op, prescale, postscale, compression, process_set, None, name,
                                                agree_name)))

    def finish(_: Any) -> List[torch.Tensor]:
        results: List[Optional[torch.Tensor]] = [None] * len(tensors)
        for members, handle in parts:
            flat = handle.wait()
            offset = 0
            for i in members:
                n = tensors[i].numel()
                piece = flat[offset:offset + n].view(tensors[i].shape)
                offset += n
                if inplace:
                    with torch.no_grad():
                        tensors[i].copy_(piece)
                    results[i] = tensors[i]
                else:
                    results[i] = piece.clone()
        return results  # type: ignore[return-value]

    return Handle(_AllOf([h for _, h in parts]), finish, name=name)


class _AllOf:
    """Done when every part is done; ``wait`` waits for all (the results stay in the parts)."""

    def __init__(self, handles: List[Handle]) -> None:
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


class _GroupedAllreduceFn(torch.autograd.Function):
    """Horovod's HorovodGroupedAllreduce: the gradients are grouped-all-reduced like the inputs."""

    @staticmethod
    def forward(ctx, op, prescale, postscale, process_set, name, *tensors):  # type: ignore[override]
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_grouped_start([t.detach() for t in tensors], op, prescale, postscale, Compression.none,
                                    process_set, False, name).wait())

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        op, prescale, postscale, process_set = ctx.args
        reduced = _grouped_start([g.contiguous() for g in grads], op, prescale, postscale, Compression.none,
                                 process_set, False, "grouped_allreduce.grad").wait()
        return (None, None, None, None, None, *reduced)


@_traced("ALLREDUCE")
@_refused_everywhere
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                      compression: Any = Compression.none, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """All-reduce a list of tensors as one fused operation; returns new tensors (differentiable)."""
    _require_init("hvd.grouped_allreduce")
    op = _resolve_op(average, op)
    if _wants_grad(tensors):
        wires, ctxs = zip(*[compression.compress(_check_tensor(t, "grouped_allreduce")) for t in tensors])
        outs = _GroupedAllreduceFn.apply(op, prescale_factor, postscale_factor, process_set,
                                         name or "grouped_allreduce", *wires)
        return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]
    return _grouped_start(tensors, op, prescale_factor, postscale_factor,
                          compression, process_set, False, name or "grouped_allreduce", name).wait()


@_traced("ALLREDUCE")
@_refused_everywhere
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start :func:`grouped_allreduce`; ``synchronize`` returns the list of new tensors."""
    _require_init("hvd.grouped_allreduce_async")
    op = _resolve_op(average, op)
    return _named(name, lambda: _grouped_start(tensors, op, prescale_factor, postscale_factor,
                                               Compression.none, process_set, False, name or "grouped_allreduce",
                                               name))


@_traced("ALLREDUCE")
@_refused_everywhere
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                       op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """In-place :func:`grouped_allreduce`; returns the same tensors."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set))


@_traced("ALLREDUCE")
@_refused_everywhere
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place grouped all-reduce."""
    _require_init("hvd.grouped_allreduce_async_")
    op = _resolve_op(average, op)
    return _named(name, lambda: _grouped_start(tensors, op, prescale_factor, postscale_factor,
                                               Compression.none, process_set, True, name or "grouped_allreduce_",
                                               name))


# --------------------------------------------------------------------------- allgather
def _allgather_raw(tensor: torch.Tensor, process_set: Optional[ProcessSet]) -> torch.Tensor:
    host, restore = staging.to_host(tensor.detach())
    _require_dims(host, "allgather")
    return restore(comm.allgather(host.contiguous(), group=_group(process_set)))


def _my_rows(dims: Sequence[int], process_set: Optional[ProcessSet]) -> Tuple[int, int]:
    """Offset and count of this rank's rows in an allgather whose ranks sent ``dims`` rows."""
    me = (process_set or global_process_set).rank()
    return sum(dims[:me]), dims[me]


class _AllgatherFn(torch.autograd.Function):
    """Horovod's HorovodAllgather: the gradient is the *average* over the set of the output
    gradients, narrowed to this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, process_set):  # type: ignore[override]
        ctx.process_set = process_set
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 0
        return _allgather_raw(tensor, process_set)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ps = ctx.process_set
        averaged = _allreduce_start(grad.contiguous(), ReduceOp.Average, 1.0, 1.0, Compression.none, ps, None,
                                    "allgather.grad", blocking=True).wait()
        start, count = _my_rows(comm.allgather_object(ctx.dim0, group=_group(ps)), ps)
        return averaged.narrow(0, start, count), None


@_traced("ALLGATHER")
def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` on dim 0 (dim 0 may differ per rank); differentiable."""
    _require_init("hvd.allgather")
    _check_tensor(tensor, "allgather")
    _negotiate("allgather", [tensor], process_set, lambda: _require_dims(tensor, "allgather"))
    if _wants_grad([tensor]):
        return _AllgatherFn.apply(tensor, process_set)
    return _allgather_raw(tensor, process_set)


@_traced("ALLGATHER")
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start :func:`allgather` in the background; ``synchronize`` returns the gathered tensor."""
    _require_init("hvd.allgather_async")
    t = _check_tensor(tensor, "allgather_async").detach()
    return _submit("allgather", [t], process_set, lambda: _require_dims(t, "allgather"),
                   lambda _: _allgather_raw(t, process_set), name or "allgather", pending=name)


class _GroupedAllgatherFn(torch.autograd.Function):
    """Horovod's HorovodGroupedAllgather: grouped average of the gradients, narrowed per tensor."""

    @staticmethod
    def forward(ctx, process_set, *tensors):  # type: ignore[override]
        ctx.process_set = process_set
        ctx.dims = [t.shape[0] if t.dim() else 0 for t in tensors]
        return tuple(_allgather_raw(t, process_set) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ps = ctx.process_set
        averaged = _grouped_start([g.contiguous() for g in grads], ReduceOp.Average, 1.0, 1.0, Compression.none,
                                  ps, False, "grouped_allgather.grad").wait()
        every = comm.allgather_object(ctx.dims, group=_group(ps))
        out = []
        for i, g in enumerate(averaged):
            start, count = _my_rows([dims[i] for dims in every], ps)
            out.append(g.narrow(0, start, count))
        return (None, *out)


@_traced("ALLGATHER")
def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """:func:`allgather` of each tensor of a list; returns the list of results (differentiable)."""
    _require_init("hvd.grouped_allgather")
    tensors = [_check_tensor(t, "grouped_allgather") for t in tensors]
    _negotiate("grouped_allgather", tensors, process_set,
               lambda: [_require_dims(t, "grouped_allgather") for t in tensors])
    if _wants_grad(tensors):
        return list(_GroupedAllgatherFn.apply(process_set, *tensors))
    return [_allgather_raw(t, process_set) for t in tensors]


@_traced("ALLGATHER")
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start :func:`grouped_allgather` in the background; ``synchronize`` returns the list."""
    _require_init("hvd.grouped_allgather_async")
    ts = [_check_tensor(t, "grouped_allgather_async").detach() for t in tensors]
    return _submit("grouped_allgather", ts, process_set, lambda: [_require_dims(t, "grouped_allgather") for t in ts],
                   lambda _: [_allgather_raw(t, process_set) for t in ts], name or "grouped_allgather",
                   pending=name)


# --------------------------------------------------------------------------- broadcast
def _root_in_set(root_rank: int, process_set: Optional[ProcessSet], what: str = "broadcast") -> int:
    """Position in the set of ``root_rank``, which is a *global* rank as in Horovod."""
    ps = process_set or global_process_set
    root = int(root_rank)
    if ps._global:
        if not 0 <= root < comm.size():
            raise ValueError(f"{what}: root_rank={root} is outside 0..{comm.size() - 1}.\n"
                             "HINT: pass the rank (hvd.rank()) of the process that holds the values")
        return root
    if root not in ps.ranks:
        raise ValueError(f"{what}: root_rank={root} is not a member of {ps}.\n"
                         "HINT: root_rank is a global rank (as in Horovod), and must be one of the set's ranks")
    return ps.ranks.index(root)


def _broadcast_raw(tensor: torch.Tensor, root_rank: int, process_set: Optional[ProcessSet]) -> torch.Tensor:
    root = _root_in_set(root_rank, process_set)
    host, restore = staging.to_host(tensor.detach())
    return restore(comm.broadcast(host.contiguous(), root=root, group=_group(process_set))).view(tensor.shape)


class _BroadcastFn(torch.autograd.Function):
    """Horovod's HorovodBroadcast: the root's gradient is the average over the set of the
    output gradients; every other rank's gradient is zero."""

    @staticmethod
    def forward(ctx, tensor, root_rank, process_set):  # type: ignore[override]
        ctx.root, ctx.process_set = int(root_rank), process_set
        return _broadcast_raw(tensor, root_rank, process_set)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        averaged = _allreduce_start(grad.contiguous(), ReduceOp.Average, 1.0, 1.0, Compression.none,
                                    ctx.process_set, None, "broadcast.grad", blocking=True).wait()
        if comm.rank() != ctx.root:
            averaged = torch.zeros_like(averaged)
        return averaged, None, None


@_traced("BROADCAST")
def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank as a new tensor (differentiable).
    ``root_rank`` is a global rank, also with a process set (Horovod's convention)."""
    _require_init("hvd.broadcast")
    _check_tensor(tensor, "broadcast")
    _negotiate("broadcast", [tensor], process_set, lambda: _root_in_set(root_rank, process_set), root=root_rank)
    if _wants_grad([tensor]):
        return _BroadcastFn.apply(tensor, root_rank, process_set)
    return _broadcast_raw(tensor, root_rank, process_set)


@_traced("BROADCAST")
def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast: ``tensor`` takes ``root_rank``'s values; returns it."""
    _require_init("hvd.broadcast_")
    _check_tensor(tensor, "broadcast_")
    _negotiate("broadcast", [tensor], process_set, lambda: _root_in_set(root_rank, process_set), root=root_rank)
    with torch.no_grad():
        tensor.copy_(_broadcast_raw(tensor, root_rank, process_set))
    return tensor


@_traced("BROADCAST")
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start :func:`broadcast` in the background; ``synchronize`` returns the new tensor."""
    _require_init("hvd.broadcast_async")
    t = _check_tensor(tensor, "broadcast_async").detach()
    return _submit("broadcast", [t], process_set, lambda: _root_in_set(root_rank, process_set),
                   lambda _: _broadcast_raw(t, root_rank, process_set), name or "broadcast", pending=name,
                   root=root_rank)


@_traced("BROADCAST")
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place broadcast in the background; ``synchronize`` returns ``tensor``."""
    _require_init("hvd.broadcast_async_")
    _check_tensor(tensor, "broadcast_async_")

    def run(_: Any) -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(_broadcast_raw(tensor, root_rank, process_set))
        return tensor

    return _submit("broadcast", [tensor], process_set, lambda: _root_in_set(root_rank, process_set), run,
                   name or "broadcast_", pending=name, root=root_rank)


# --------------------------------------------------------------------------- alltoall
def _alltoall_splits(tensor: torch.Tensor, splits: Any, n: int) -> Optional[List[int]]:
    if splits is None:
        if tensor.dim() == 0 or tensor.shape[0] % n:
            raise ValueError(f"alltoall without splits needs dim 0 ({tuple(tensor.shape)[:1]}) divisible by "
                             f"the number of ranks ({n}).\nHINT: pass splits=[rows for rank 0, rows for rank 1, ...]")
        return None
    split_list = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(split_list) != n or any(s < 0 for s in split_list) or sum(split_list) != tensor.shape[0]:
        raise ValueError(f"alltoall splits {split_list}: expected {n} non-negative counts summing to "
                         f"dim 0 of the tensor ({tensor.shape[0]})")
    return split_list


def _alltoall_raw(tensor: torch.Tensor, split_list: Optional[List[int]],
                  process_set: Optional[ProcessSet]) -> Tuple[torch.Tensor, torch.Tensor]:
    host, restore = staging.to_host(tensor.detach())
    out, received = comm.alltoall(host.contiguous(), splits=split_list, group=_group(process_set))
    return restore(out), torch.as_tensor(list(received), dtype=torch.int32)


class _AlltoallFn(torch.autograd.Function):
    """Horovod's HorovodAlltoall: the gradient goes back with an alltoall using the received
    splits as send splits."""

    @staticmethod
    def forward(ctx, tensor, split_list, process_set):  # type: ignore[override]
        out, received = _alltoall_raw(tensor, split_list, process_set)
        ctx.process_set, ctx.received = process_set, [int(r) for r in received.tolist()]
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _received_grad):  # type: ignore[override]
        back, _ = _alltoall_raw(grad.contiguous(), ctx.received, ctx.process_set)
        return back, None, None


@_traced("ALLTOALL")
def alltoall(tensor: torch.Tensor, splits: Optional[Union[Sequence[int], torch.Tensor]] = None,
             name: Optional[str] = None, process_set: ProcessSet = global_process_set
             ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Send ``splits[i]`` rows of dim 0 to rank i (even split when None); return the rows
    received, concatenated in rank order — and, when ``splits`` is given, the received splits.
    Differentiable."""
    _require_init("hvd.alltoall")
    _check_tensor(tensor, "alltoall")
    split_list = _negotiate("alltoall", [tensor], process_set,
                            lambda: _alltoall_splits(tensor, splits, _group_size(process_set)))
    if _wants_grad([tensor]):
        out, received = _AlltoallFn.apply(tensor, split_list, process_set)
    else:
        out, received = _alltoall_raw(tensor, split_list, process_set)
    return out if splits is None else (out, received)


@_traced("ALLTOALL")
def alltoall_async(tensor: torch.Tensor, splits: Optional[Union[Sequence[int], torch.Tensor]] = None,
                   name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> Handle:
    """Start :func:`alltoall` in the background; ``synchronize`` returns ``(tensor,
    received_splits)``, as Horovod's does (with or without ``splits``)."""
    _require_init("hvd.alltoall_async")
    t = _check_tensor(tensor, "alltoall_async").detach()
    return _submit("alltoall", [t], process_set, lambda: _alltoall_splits(t, splits, _group_size(process_set)),
                   lambda split_list: _alltoall_raw(t, split_list, process_set), name or "alltoall",
                   pending=name)


# --------------------------------------------------------------------------- reducescatter
def _reducescatter_op(op: Optional[int]) -> ReduceOp:
    op = _resolve_op(None, op)
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"reducescatter supports op=Average and op=Sum, got {op.name}")
    return op


def _reducescatter_raw(tensor: torch.Tensor, op: ReduceOp, process_set: Optional[ProcessSet],
                       prescale: float, postscale: float) -> torch.Tensor:
    """This rank's rows of the reduction: rows split as Horovod does (the first ``dim0 % size``
    ranks of the set get one row more); Average is a Sum scaled by postscale/size."""
    _require_dims(tensor, "reducescatter")
    n = _group_size(process_set)
    host, restore = staging.to_host(tensor.detach())
    buf = _scale_(host.contiguous().clone(), prescale)
    part = comm.reduce_scatter(buf, op="sum", group=_group(process_set))
    return restore(_scale_(part, postscale / n if op == ReduceOp.Average else postscale))


class _ReducescatterFn(torch.autograd.Function):
    """Horovod's HorovodReducescatter: the gradient is the allgather of the output gradient,
    times the set size for Sum and times the scale factors."""

    @staticmethod
    def forward(ctx, tensor, op, process_set, prescale, postscale):  # type: ignore[override]
        ctx.args = (op, process_set, prescale, postscale)
        return _reducescatter_raw(tensor, op, process_set, prescale, postscale)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        op, process_set, prescale, postscale = ctx.args
        factor = (_group_size(process_set) if op == ReduceOp.Sum else 1) * prescale * postscale
        return _allgather_raw(grad * factor if factor != 1 else grad, process_set), None, None, None, None


@_traced("REDUCESCATTER")
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = Compression.none,
                  op: Optional[int] = None, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's rows of dim 0 (the first
    ``dim0 % size`` ranks get one row more). ``op``: Average (default) or Sum. Differentiable."""
    _require_init("hvd.reducescatter")
    _check_tensor(tensor, "reducescatter")
    op = _negotiate("reducescatter", [tensor], process_set,
                    lambda: (_require_dims(tensor, "reducescatter"), _reducescatter_op(op))[1],
                    op=_op_field(op), prescale=float(prescale_factor), postscale=float(postscale_factor))
    wire, cctx = compression.compress(tensor)
    if _wants_grad([tensor]):
        part = _ReducescatterFn.apply(wire, op, process_set, prescale_factor, postscale_factor)
    else:
        part = _reducescatter_raw(wire, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(part, cctx)


@_traced("REDUCESCATTER")
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = Compression.none,
                        op: Optional[int] = None, process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start :func:`reducescatter` in the background; ``synchronize`` returns this rank's part."""
    _require_init("hvd.reducescatter_async")
    t = _check_tensor(tensor, "reducescatter_async").detach()

    def run(rop: ReduceOp) -> torch.Tensor:
        wire, cctx = compression.compress(t)
        return compression.decompress(_reducescatter_raw(wire, rop, process_set, prescale_factor, postscale_factor),
                                      cctx)

    return _submit("reducescatter", [t], process_set,
                   lambda: (_require_dims(t, "reducescatter"), _reducescatter_op(op))[1], run,
                   name or "reducescatter", pending=name, op=_op_field(op), prescale=float(prescale_factor),
                   postscale=float(postscale_factor))


class _GroupedReducescatterFn(torch.autograd.Function):
    """Horovod's HorovodGroupedReducescatter: scaled output gradients, grouped-allgathered."""

    @staticmethod
    def forward(ctx, op, process_set, prescale, postscale, *tensors):  # type: ignore[override]
        ctx.args = (op, process_set, prescale, postscale)
        return tuple(_reducescatter_raw(t, op, process_set, prescale, postscale) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        op, process_set, prescale, postscale = ctx.args
        factor = (_group_size(process_set) if op == ReduceOp.Sum else 1) * prescale * postscale
        return (None, None, None, None, *[_allgather_raw(g * factor, process_set) for g in grads])


@_traced("REDUCESCATTER")
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Any = Compression.none, op: Optional[int] = None,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """:func:`reducescatter` of each tensor of a list; returns the list of parts (differentiable)."""
    _require_init("hvd.grouped_reducescatter")
    tensors = [_check_tensor(t, "grouped_reducescatter") for t in tensors]
    op = _negotiate("grouped_reducescatter", tensors, process_set,
                    lambda: ([_require_dims(t, "reducescatter") for t in tensors], _reducescatter_op(op))[1],
                    op=_op_field(op), prescale=float(prescale_factor), postscale=float(postscale_factor))
    wires, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    if _wants_grad(tensors):
        parts = _GroupedReducescatterFn.apply(op, process_set, prescale_factor, postscale_factor, *wires)
    else:
        parts = [_reducescatter_raw(w, op, process_set, prescale_factor, postscale_factor) for w in wires]
    return [compression.decompress(p, c) for p, c in zip(parts, ctxs)]


@_traced("REDUCESCATTER")
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: Optional[int] = None, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start :func:`grouped_reducescatter` in the background; ``synchronize`` returns the parts."""
    _require_init("hvd.grouped_reducescatter_async")
    ts = [_check_tensor(t, "grouped_reducescatter_async").detach() for t in tensors]
    return _submit("grouped_reducescatter", ts, process_set,
                   lambda: ([_require_dims(t, "reducescatter") for t in ts], _reducescatter_op(op))[1],
                   lambda rop: [_reducescatter_raw(t, rop, process_set, prescale_factor, postscale_factor)
                                for t in ts],
                   name or "grouped_reducescatter", pending=name, op=_op_field(op),
                   prescale=float(prescale_factor),
                   postscale=float(postscale_factor))


# --------------------------------------------------------------------------- sparse
class _CallableHandle(Handle):
    """Horovod's sparse_allreduce_async returns a function that yields the result; this handle
    is both that function and a handle for ``synchronize``/``poll``."""

    __slots__ = ()

    def __call__(self) -> Any:
        return self.wait()


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set) -> Handle:
    """Reduce a sparse COO tensor by allgathering its indices and values (Horovod's sparse
    path): duplicates add up when the result is coalesced; op=Average divides the values by the
    set size. Call the returned handle (or ``synchronize`` it) for the result."""
    _require_init("hvd.sparse_allreduce_async")
    t = tensor
    indices = _allgather_raw(t._indices().transpose(0, 1).contiguous(), process_set)
    values = _allgather_raw(t._values().contiguous(), process_set)
    if _resolve_op(None, op) == ReduceOp.Average:
        values = values / _group_size(process_set)
    result = torch.sparse_coo_tensor(indices.transpose(0, 1), values, t.size())
    return _CallableHandle(result=result, name=f"{name}")


# --------------------------------------------------------------------------- join, barrier
def join(device: int = -1) -> int:
    """Horovod's join: until every rank has called ``join()``, this rank takes part in the
    other ranks' all-reduces with zeros (so ``DistributedOptimizer`` steps on ranks with more
    batches complete: Sum gives their sum, Average divides by ``size()``); other collectives
    called meanwhile raise HorovodInternalError on the ranks that call them. Returns the rank
    that joined last. ``device`` is accepted (tensors stand in on the host)."""
    _require_init("hvd.join")
    try:
        return comm.join()
    except CollectiveMismatchError as e:
        raise _Mismatch(str(e)) from e


@_traced("BARRIER")
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` has reached the barrier."""
    _require_init("hvd.barrier")
    try:
        comm.barrier(group=_group(process_set))
    except CollectiveMismatchError as e:  # e.g. ranks have joined (hvd.join)
        raise _Mismatch(f"barrier: {e}") from e
