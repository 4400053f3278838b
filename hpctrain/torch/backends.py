"""Who moves the bytes of the gradient buckets: ``mpi`` (hpctrain.comm, the default), ``gloo``
and ``nccl`` (torch.distributed, bootstrapped through MPI: no torchrun, no MASTER_ADDR), and
``horovod`` (when it is installed).

Every backend offers the same three calls on a flat, contiguous buffer: ``allreduce_async``
(in place, returns an object with ``wait()`` and ``done()``), ``broadcast_`` and ``barrier``.
Submission order is the only matching rule, the same as for hpctrain.comm.

torch.distributed rendezvous: rank 0 starts a ``TCPStore`` on a port the system picks (and
keeps it bound), its address travels to every rank over MPI, the others connect to it, and
every rank calls ``init_process_group(store=...)`` (``comm.rendezvous_store()``). The address
is rank 0's host address; ``HPCTRAIN_RENDEZVOUS_ADDR`` overrides it (e.g. the address of a
fast interface).
"""
from __future__ import annotations

import datetime
import logging
from typing import Any, Dict, Optional

import torch

from hpctrain import comm, settings

from . import staging

log = logging.getLogger("hpctrain.torch")

BACKENDS = ("mpi", "gloo", "nccl", "horovod")
_cache: Dict[str, "Backend"] = {}


class _Done:
    """An already finished operation."""

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


class Backend:
    """Interface of a data-movement backend."""

    name = "?"

    def allreduce_async(self, buf: torch.Tensor, op: str, name: str = "") -> Any:
        """Start an in-place reduction of ``buf`` (op: sum, avg, min, max, prod)."""
        raise NotImplementedError

    def broadcast_(self, buf: torch.Tensor, root: int) -> torch.Tensor:
        """Overwrite ``buf`` with ``root``'s values."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait for every rank."""
        raise NotImplementedError


class MPIBackend(Backend):
    """hpctrain.comm: ring / shared-memory / native MPI all-reduce chosen by size.

    ``group``: an ``hpctrain.comm.Group`` to reduce over instead of the world (a process set);
    ``root`` of ``broadcast_`` is then a rank of that group."""

    name = "mpi"

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def allreduce_async(self, buf: torch.Tensor, op: str, name: str = "") -> Any:
        host, restore = staging.to_host(buf)
        handle = comm.allreduce_async(host, op=op, inplace=True, group=self.group)
        if host is buf:
            return handle
        return _Staged(handle, host, buf, restore)

    def broadcast_(self, buf: torch.Tensor, root: int) -> torch.Tensor:
        host, restore = staging.to_host(buf)
        comm.broadcast_(host, root=root, group=self.group)
        if host is not buf:
            buf.copy_(restore(host))
        return buf

    def barrier(self) -> None:
        comm.barrier(group=self.group)


class _Staged:
    """Copies a staged host result back into the device buffer on ``wait()``."""

    def __init__(self, inner: Any, host: torch.Tensor, target: torch.Tensor, restore: Any) -> None:
        self.inner, self.host, self.target, self.restore = inner, host, target, restore

    def wait(self) -> None:
        self.inner.wait()
        self.target.copy_(self.restore(self.host))

    def done(self) -> bool:
        return self.inner.done()


class _TorchWork:
    def __init__(self, work: Any, buf: torch.Tensor, divide: int) -> None:
        self.work, self.buf, self.divide, self.finished = work, buf, divide, False

    def wait(self) -> None:
        if not self.finished:
            self.work.wait()
            if self.divide > 1:
                if self.buf.dtype.is_floating_point:
                    self.buf.div_(self.divide)
                else:
                    self.buf.copy_(torch.div(self.buf, self.divide, rounding_mode="trunc"))
            self.finished = True

    def done(self) -> bool:
        return self.finished or self.work.is_completed()


def init_torch_distributed(backend: str, timeout_s: float = 300.0) -> None:
    """``torch.distributed.init_process_group(backend)`` with the rendezvous done over MPI.

    Idempotent; an existing process group of another backend is an error.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        have = dist.get_backend()
        if have != backend:
            raise RuntimeError(f"torch.distributed is already initialized with backend {have!r}, "
                               f"but {backend!r} was requested.\nHINT: use backend={have!r}, or destroy "
                               "the existing process group first")
        return
    comm.init()
    host = None
    override = settings.rc.rendezvous_addr
    if override:
        host = override
    store = comm.rendezvous_store(host, timeout_s=timeout_s)
    dist.init_process_group(backend, store=store, rank=comm.rank(), world_size=comm.size(),
                            timeout=datetime.timedelta(seconds=timeout_s))
    _cache.setdefault("_torch_pg_owner", TorchDistBackend.__new__(TorchDistBackend))


class TorchDistBackend(Backend):
    """torch.distributed with Gloo (CPU) or NCCL (CUDA tensors)."""

    _OPS = {"sum": "SUM", "avg": "SUM", "min": "MIN", "max": "MAX", "prod": "PRODUCT"}

    def __init__(self, backend: str) -> None:
        import torch.distributed as dist

        available = dist.is_available() and (dist.is_gloo_available() if backend == "gloo" else dist.is_nccl_available())
        if not available:
            raise RuntimeError(f"backend={backend!r}: this PyTorch has no {backend.upper()} support.\n"
                               "HINT: use backend='mpi' (the default)")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("backend='nccl' needs CUDA devices; none is visible.\n"
                               "HINT: use backend='mpi' or backend='gloo' on CPU machines")
        self.name = backend
        self.dist = dist
        init_torch_distributed(backend)

    def allreduce_async(self, buf: torch.Tensor, op: str, name: str = "") -> Any:
        reduce_op = getattr(self.dist.ReduceOp, self._OPS[op])
        work = self.dist.all_reduce(buf, op=reduce_op, async_op=True)
        return _TorchWork(work, buf, self.dist.get_world_size() if op == "avg" else 1)

    def broadcast_(self, buf: torch.Tensor, root: int) -> torch.Tensor:
        self.dist.broadcast(buf, src=root)
        return buf

    def barrier(self) -> None:
        self.dist.barrier()


class HorovodBackend(Backend):
    """Horovod's own all-reduce (``horovod.torch``), for comparison runs."""

    name = "horovod"

    def __init__(self) -> None:
        try:
            import horovod.torch as hvd  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(f"backend='horovod' but horovod.torch cannot be imported ({exc}).\n"
                               "HINT: install Horovod (see docs/torch.md) or use backend='mpi'") from None
        self.hvd = hvd
        hvd.init()

    def allreduce_async(self, buf: torch.Tensor, op: str, name: str = "") -> Any:
        hvd = self.hvd
        ops = {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}
        handle = hvd.allreduce_async_(buf, op=ops[op], name=name or None)
        return _HorovodWork(hvd, handle)

    def broadcast_(self, buf: torch.Tensor, root: int) -> torch.Tensor:
        return self.hvd.broadcast_(buf, root)

    def barrier(self) -> None:
        self.hvd.allreduce(torch.zeros(1), name="hpctrain.barrier")


class _HorovodWork:
    def __init__(self, hvd: Any, handle: Any) -> None:
        self.hvd, self.handle, self.finished = hvd, handle, False

    def wait(self) -> None:
        if not self.finished:
            self.hvd.synchronize(self.handle)
            self.finished = True

    def done(self) -> bool:
        return self.finished or bool(self.hvd.poll(self.handle))


def get_backend(name: Optional[str] = None) -> Backend:
    """The backend called ``name`` (default: ``HPCTRAIN_BACKEND`` or ``mpi``), created once."""
    name = (name or settings.rc.backend).lower()
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: expected one of {', '.join(BACKENDS)}")
    if name not in _cache:
        if name == "mpi":
            _cache[name] = MPIBackend()
        elif name in ("gloo", "nccl"):
            _cache[name] = TorchDistBackend(name)
        else:
            _cache[name] = HorovodBackend()
    return _cache[name]


def shutdown_backends() -> None:
    """Tear down what :func:`get_backend` started (torch.distributed group, Horovod)."""
    owned = _cache.pop("_torch_pg_owner", None)
    for key in ("gloo", "nccl"):
        _cache.pop(key, None)
    if owned is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    hvd_backend = _cache.pop("horovod", None)
    if hvd_backend is not None:
        hvd_backend.hvd.shutdown()
    _cache.pop("mpi", None)
