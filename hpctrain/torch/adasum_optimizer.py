"""``DistributedOptimizer(op=hvd.Adasum)`` on more than one rank: Horovod's delta optimizer.

Adasum combines what each rank would do to the weights, not the raw gradients. As in
Horovod's ``_DistributedAdasumOptimizer``, each parameter is stepped locally by the wrapped
optimizer as soon as its gradient is ready (its hook), from a copy of its weights ``start``;
the parameter then holds the local delta ``stepped - start``. ``step()`` combines every
parameter's delta over the ranks by Adasum (one exchange, each parameter with its own
coefficients) and sets the parameter to ``start + combined delta``. The combined delta is the
same on every rank, so weights that start equal (``broadcast_parameters``) stay equal; the
wrapped optimizer's state (momentum, Adam moments) stays local to each rank, as in Horovod.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, List, Optional

import torch

from hpctrain import comm

from . import adasum
from . import buckets as bk
from .compression import Compression
from .ops import ReduceOp, _require_init, global_process_set, grouped_allreduce_
from .optimizer import DistributedOptimizer
from .strategies import AllReduce, parse_sync


class AdasumOptimizer(DistributedOptimizer):
    """What ``hvd.DistributedOptimizer(optimizer, op=hvd.Adasum)`` returns on more than one
    rank (same arguments). Needs the global process set and a power-of-two number of ranks;
    ``gradient_predivide_factor``, ``sync``, ``backend`` other than ``mpi`` and
    ``bucket_allocator`` are refused; ``groups``, ``sparse_as_dense``, ``fusion_threshold``
    and ``overlap`` do not apply (every delta goes in one exchange at ``step()``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1,
                 op: int = ReduceOp.Adasum, gradient_predivide_factor: float = 1.0, groups: Any = None,
                 sparse_as_dense: bool = False, *, sync: Any = "allreduce", backend: Optional[str] = None,
                 fusion_threshold: Optional[int] = None, bucket_allocator: Any = None,
                 overlap: Optional[bool] = None, process_set: Any = global_process_set) -> None:
        _require_init("hvd.DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
        # Raised before any communication: every rank that creates the optimizer sees the same.
        if process_set is not None and process_set is not global_process_set:
            raise NotImplementedError("Adasum does not support non-global process sets yet.\n"
                                      "HINT: use op=hvd.Average with a process set, or Adasum over all ranks")
        adasum.check_ranks(None)
        self._inner = optimizer
        self._group = None
        self._rank, self._size = comm.rank(), comm.size()
        self._op = ReduceOp.Adasum
        self._compression = compression
        self._predivide = float(gradient_predivide_factor)
        self.backward_passes_per_step = max(1, int(backward_passes_per_step))
        self._strategy = AllReduce()
        error, specs = self._check_adasum(named_parameters, gradient_predivide_factor, backward_passes_per_step,
                                          sync, backend, bucket_allocator)
        self._verify_across_ranks(error, specs, 0, None, "mpi", sync)
        self._init_adasum_state()

    def _check_adasum(self, named_parameters, gradient_predivide_factor, backward_passes_per_step, sync, backend,
                      bucket_allocator):
        """This rank's verdict on its arguments (the error or None, the parameter specs)."""
        try:
            if gradient_predivide_factor != 1.0:
                raise ValueError("gradient_predivide_factor not supported with op != Average")
            if int(backward_passes_per_step) < 1:
                raise ValueError(f"backward_passes_per_step={backward_passes_per_step}: expected an integer >= 1")
            if not isinstance(parse_sync(sync), AllReduce):
                raise ValueError(f"op=Adasum combines every rank's step: sync={sync!r} does not apply.\n"
                                 "HINT: leave sync at 'allreduce'")
            if backend is not None and str(backend).lower() != "mpi":
                raise ValueError(f"op=Adasum runs over MPI; backend={backend!r} is not supported.\n"
                                 "HINT: leave backend unset (or 'mpi')")
            if bucket_allocator is not None:
                raise ValueError("op=Adasum keeps no gradient buckets: bucket_allocator does not apply")
            self._params, self._names = self._collect(named_parameters)
        except (ValueError, TypeError) as exc:
            return exc, []
        return None, [bk.ParamSpec(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._names, self._params)]

    def _init_adasum_state(self) -> None:
        self._lock = threading.RLock()
        self._starts = [torch.zeros_like(p, requires_grad=False) for p in self._params]
        self._delay = [self.backward_passes_per_step] * len(self._params)
        self._stepped = [False] * len(self._params)  # stepped locally: the parameter holds its delta
        self._should_synchronize = True
        self._synchronized = False
        self._no_sync_depth = 0
        self._passthrough = False
        self._buffers: List[torch.Tensor] = []
        self._shared = False
        self.wait_seconds = 0.0
        self._hook_handles: List[Any] = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                                         for i, p in enumerate(self._params)]

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._inner!r}, op=Adasum)"

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if self._no_sync_depth:
                return
            with self._lock:
                if self._delay[i] <= 0:
                    raise AssertionError(
                        f"Gradients were computed more than backward_passes_per_step="
                        f"{self.backward_passes_per_step} times before call to step() (parameter "
                        f"{self._names[i]!r}).\nHINT: increase backward_passes_per_step to accumulate gradients "
                        "locally")
                self._delay[i] -= 1
                if self._delay[i] == 0:
                    self._local_step(i)

        return hook

    def _local_step(self, i: int) -> None:
        """Step parameter ``i`` alone with the wrapped optimizer; leave its delta in it."""
        p, start = self._params[i], self._starts[i]
        stashed = [group["params"] for group in self._inner.param_groups]
        for group in self._inner.param_groups:
            group["params"] = [p] if any(q is p for q in group["params"]) else []
        try:
            with torch.no_grad():
                start.copy_(p)
            self._inner.step()
            with torch.no_grad():
                p.sub_(start)
        finally:
            for group, params in zip(self._inner.param_groups, stashed):
                group["params"] = params
        self._stepped[i] = True

    def synchronize(self) -> None:
        """Nothing to do: with Adasum the communication happens in ``step()`` (as in Horovod)."""
        self._check_alive("synchronize()")

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Not supported with Adasum, as in Horovod."""
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover - makes this a generator

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """Reset the gradients; refused between a backward pass and ``step()``."""
        if any(self._stepped) or any(d < self.backward_passes_per_step for d in self._delay):
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition.\n"
                "HINT: call optimizer.step() first, or zero_grad() before the backward pass")
        self._inner.zero_grad(set_to_none)

    def step(self, closure: Optional[Callable[[], float]] = None, **_: Any) -> Any:
        """Step every parameter not stepped yet, combine the deltas by Adasum over the ranks
        (in parameter order: the same on every rank), then apply them to the start weights."""
        self._check_alive("step()")
        loss = closure() if closure is not None else None
        with self._lock:
            for i in range(len(self._params)):
                if not self._stepped[i]:
                    self._local_step(i)
            wires, ctxs = [], []
            for p in self._params:
                wire, ctx = self._compression.compress(p.data)
                wires.append(wire.data)
                ctxs.append(ctx)
            grouped_allreduce_(wires, op=ReduceOp.Adasum, name="hpctrain.adasum.deltas")
            with torch.no_grad():
                for p, start, wire, ctx in zip(self._params, self._starts, wires, ctxs):
                    start.add_(self._compression.decompress(wire, ctx).to(start.dtype))
                    p.copy_(start)
            self._delay = [self.backward_passes_per_step] * len(self._params)
            self._stepped = [False] * len(self._params)
        return loss
