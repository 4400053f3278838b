"""Collectives on device (CUDA) tensors, for an MPI library that reads and writes device memory.

:func:`cuda_support` asks the MPI library mpi4py loaded whether it is CUDA-aware:
``MPIX_Query_cuda_support()``, an extension of Open MPI and MPICH, looked up by name in
the loaded library (as ``mpiring`` finds ``MPI_Isend``), so no MPI header is needed and a
library without the extension reads as "not CUDA-aware". MPICH switches its GPU support
off at run time with ``MPIR_CVAR_ENABLE_GPU=0``, which the query honours too.

The collectives here hand the tensor's memory to MPI as it is (mpi4py takes a torch tensor
through DLPack, on the host or the device) and run the native MPI collective: the ring,
shared-memory and hierarchical algorithms reduce with host kernels and cannot read device
memory. Reductions of dtypes MPI has no type for (float16, bfloat16, bool, complex) copy
through the host. The agreement check and the stall watchdog run as for host buffers.

Device tensors are accepted when the query says the library is CUDA-aware, or when the
caller vouches for it (:func:`accept_device_buffers`, ``hpctrain.torch``'s decision,
which also honours ``HPCTRAIN_CUDA_AWARE_MPI``).
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Any, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from . import guard, plan
from .algorithms import _mpi_op
from .buffers import check_op, is_torch_tensor
from .world import Group, watchdog

log = logging.getLogger("hpctrain.comm")

_state = {"support": None, "accept": None}

# MPI datatypes of the dtypes MPI reduces itself; other dtypes are reduced through the host.
_REDUCE_TYPES = {"float32": MPI.FLOAT, "float64": MPI.DOUBLE, "int8": MPI.INT8_T, "uint8": MPI.UINT8_T,
                 "int16": MPI.INT16_T, "int32": MPI.INT32_T, "int64": MPI.INT64_T}


def query_cuda_support() -> bool:
    """Ask the MPI library (uncached): True when it reports that it reads CUDA memory."""
    try:
        lib = ctypes.CDLL(MPI.__file__)  # already loaded; its lookups reach libmpi
        query = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):  # not Open MPI / MPICH, or built without the extension
        return False
    query.restype, query.argtypes = ctypes.c_int, []
    if os.environ.get("MPIR_CVAR_ENABLE_GPU", "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return query() == 1


def cuda_support() -> bool:
    """:func:`query_cuda_support`, asked once per process."""
    if _state["support"] is None:
        _state["support"] = query_cuda_support()
        log.debug("hpctrain: MPI library CUDA-aware: %s", _state["support"])
    return bool(_state["support"])


def accept_device_buffers(on: Optional[bool]) -> None:
    """Accept device tensors (True), refuse them (False), or follow :func:`cuda_support` (None)."""
    _state["accept"] = on


def accepts_device_buffers() -> bool:
    """Whether the collectives take device tensors as they are."""
    return cuda_support() if _state["accept"] is None else bool(_state["accept"])


def on_device(x: Any) -> bool:
    """True for a torch tensor outside host memory, when device buffers are accepted (a device
    tensor that is not accepted goes on to ``flatten``, whose error says to stage it)."""
    return is_torch_tensor(x) and not x.is_cpu and accepts_device_buffers()


def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


def _checked(x: Any, what: str) -> Any:
    if x.is_sparse:
        raise ValueError(f"{what}: sparse tensors are not supported. HINT: pass x.to_dense()")
    if not x.is_contiguous():
        raise ValueError(f"{what}: tensor is not contiguous. HINT: pass x.contiguous()")
    return x.detach()


def ready(x: Any) -> None:
    """Wait for the kernels queued on ``x``'s stream: MPI reads the memory directly, outside
    the stream order, so a pending write (a clone, a scaling) must be finished first."""
    if x.is_cuda:
        import torch

        torch.cuda.current_stream(x.device).synchronize()


def _bytes(x: Any) -> Any:
    """A flat uint8 view of a contiguous tensor (any dtype travels as bytes)."""
    import torch

    return x.reshape(-1).view(torch.uint8)


def _all_ranks(g: Group):
    return lambda: f"one or more of the {g.size} ranks of group '{g.name}'"


def allreduce(g: Group, x: Any, op: str, inplace: bool) -> Any:
    """All-reduce a device tensor with MPI_Allreduce on its memory; ``x`` itself when in place."""
    check_op(op)
    t = _checked(x, "allreduce")
    name = _dtype_name(t)
    if op in ("min", "max") and t.is_complex():
        raise ValueError(f"allreduce: op {op!r} is not defined for complex dtype {name}")
    out = t if inplace else t.clone()
    dog = watchdog()
    header = guard.make_header(0, "allreduce", op, name, t.numel(), "native", 0)
    guard.agree(g, header, dog)
    if g.size > 1 and out.numel():
        with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
            mpi_type = _REDUCE_TYPES.get(name)
            if mpi_type is None:
                _through_host(g, out, op, name)
            else:
                ready(out)
                g.comm.Allreduce(MPI.IN_PLACE, [out, mpi_type], op=_mpi_op(op, name))
                if op == "avg":
                    _divide(out, g.size)
    return x if inplace else out


def _through_host(g: Group, out: Any, op: str, name: str) -> None:
    """Reduce a dtype MPI has no type for on the host, as the host path does."""
    from .algorithms import native_
    from .buffers import flatten

    host = out.cpu()
    native_(g.comm, flatten(host, writable=True, what="allreduce").array, op, name)
    out.copy_(host)


def _divide(t: Any, n: int) -> None:
    """An average from a sum; integer averages truncate toward zero (as on the host path)."""
    import torch

    if t.is_floating_point() or t.is_complex():
        t.div_(n)
    else:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))


def broadcast_(g: Group, x: Any, root: int) -> Any:
    """Overwrite a device tensor with ``root``'s values (MPI_Bcast of its bytes); returns ``x``."""
    t = _checked(x, "broadcast")
    dog = watchdog()
    header = guard.make_header(0, "broadcast", "-", _dtype_name(t), t.numel(), "-", root + 1)
    guard.agree(g, header, dog)
    if g.size > 1 and t.numel():
        ready(t)
        with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
            g.comm.Bcast([_bytes(t), MPI.BYTE], root=root)
    return x


def _rows(t: Any) -> Tuple[int, tuple]:
    shape = tuple(t.shape) or (1,)
    return shape[0], shape[1:]


def allgather(g: Group, x: Any) -> Any:
    """Concatenate every rank's device tensor along dimension 0 (MPI_Allgatherv of bytes)."""
    import torch

    t = _checked(x, "allgather")
    rows, rest = _rows(t)
    dog = watchdog()
    header = guard.make_header(0, "allgather", "-", _dtype_name(t), -1, "-", guard.shape_code(rest))
    guard.agree(g, header, dog)
    row_bytes = int(np.prod(rest, dtype=np.int64)) * t.element_size()
    counts = np.empty(g.size, dtype=np.int64)
    with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
        g.comm.Allgather(np.array([rows], dtype=np.int64), counts)
        out = torch.empty((int(counts.sum()), *rest), dtype=t.dtype, device=t.device)
        byte_counts = counts * row_bytes
        displs = np.concatenate([[0], np.cumsum(byte_counts)[:-1]])
        ready(t)
        g.comm.Allgatherv([_bytes(t), MPI.BYTE], [_bytes(out), (byte_counts, displs), MPI.BYTE])
    return out


def reduce_scatter(g: Group, x: Any, op: str) -> Any:
    """Reduce a device tensor over ranks and return this rank's rows of dimension 0 (the first
    ranks get one row more), as a new tensor on the same device."""
    check_op(op)
    t = _checked(x, "reduce_scatter")
    rows, rest = _rows(t)
    bounds = plan.chunk_bounds(rows, g.size)
    a, b = bounds[g.rank]
    # reduced whole and cut (as the host path does for dtypes MPI cannot reduce): every dtype
    # takes the same steps, at the cost of the whole vector's traffic
    full = t.clone()
    dog = watchdog()
    header = guard.make_header(0, "reduce_scatter", op, _dtype_name(t), t.numel())
    guard.agree(g, header, dog)
    if g.size > 1 and full.numel():
        with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
            mpi_type = _REDUCE_TYPES.get(_dtype_name(t))
            if mpi_type is None:
                _through_host(g, full, op, _dtype_name(t))
            else:
                ready(full)
                g.comm.Allreduce(MPI.IN_PLACE, [full, mpi_type], op=_mpi_op(op, _dtype_name(t)))
                if op == "avg":
                    _divide(full, g.size)
    return full.reshape(rows, *rest)[a:b].clone() if t.dim() else full


def alltoall(g: Group, x: Any, splits: Optional[Sequence[int]]) -> Tuple[Any, np.ndarray]:
    """Send rows ``splits[i]`` of a device tensor to rank i (MPI_Alltoallv of bytes); return the
    rows received, in rank order, and how many came from each rank."""
    import torch

    t = _checked(x, "alltoall")
    rows, rest = _rows(t)
    counts = plan.alltoall_splits(rows, g.size, splits)
    dog = watchdog()
    header = guard.make_header(0, "alltoall", "-", _dtype_name(t), -1, "-", guard.shape_code(rest))
    guard.agree(g, header, dog)
    row_bytes = int(np.prod(rest, dtype=np.int64)) * t.element_size()
    recv = np.empty(g.size, dtype=np.int64)
    with dog.watch(lambda: guard.describe_header(header) + f" on {g.name}", _all_ranks(g)):
        g.comm.Alltoall(counts, recv)
        sc, rc = counts * row_bytes, recv * row_bytes
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
        out = torch.empty((int(recv.sum()), *rest), dtype=t.dtype, device=t.device)
        ready(t)
        g.comm.Alltoallv([_bytes(t), (sc, sd), MPI.BYTE], [_bytes(out), (rc, rd), MPI.BYTE])
    return out, recv
