"""``DistributedOptimizer``: Horovod's optimizer wrapper, with fused buckets and overlap.

Walk of one training step (``sync="allreduce"``):

1. At construction the parameters (those of the wrapped optimizer that require gradients) are
   listed in registration order, checked once across ranks (same names, shapes, dtypes, same
   options — a clear error on every rank otherwise, never a hang), and planned into buckets by
   :func:`hpctrain.torch.buckets.plan_buckets`. Each bucket is one flat buffer and every
   parameter's ``.grad`` becomes a *view* into it: the all-reduce reads and writes the
   gradients where the optimizer finds them, with no copy out. After ``zero_grad()`` (PyTorch's
   default ``set_to_none=True``) autograd creates new gradient tensors and the hook moves each
   into its slot — one pass, which for ``op=Average`` also divides by the rank count so the
   all-reduce is a plain sum; with ``set_to_none=False`` autograd accumulates into the slot.
2. During ``loss.backward()`` a post-accumulate-grad hook on each parameter counts it ready.
   When every parameter of a bucket is ready, the bucket is all-reduced asynchronously (the
   comm layer's background thread) while backward continues with earlier layers. Buckets are
   started strictly in plan order, so every rank submits the same collectives in the same order
   even when hooks fire in a different order or not at all.
3. ``step()`` (or ``synchronize()``) starts any bucket not yet started — a parameter that got no
   gradient on this rank contributes zeros, since another rank may have one — waits for all of
   them, then runs the wrapped optimizer.

``backward_passes_per_step=k``: gradients of k backward passes are summed locally before one
all-reduce (Horovod semantics: divide the loss by k for the average of a k-times batch).
``no_sync()``: backward passes inside it only accumulate.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from hpctrain import comm, settings

from . import buckets as bk
from .backends import Backend, MPIBackend, get_backend
from .compression import Compression, NoneCompressor
from .ops import HpctrainNotInitialized, ProcessSet, ReduceOp, _require_init, _resolve_op, global_process_set
from .strategies import AllReduce, ModelAverage, ParameterServer, Strategy, parse_sync

log = logging.getLogger("hpctrain.torch")

__all__ = ["DistributedOptimizer", "Allocator", "choose_overlap"]

#: ``allocator(numel, dtype, device) -> 1-D zero-filled tensor`` for a bucket's flat buffer.
Allocator = Callable[[int, torch.dtype, torch.device], torch.Tensor]

_COMM_OP = {ReduceOp.Average: "avg", ReduceOp.Sum: "sum", ReduceOp.Min: "min", ReduceOp.Max: "max",
            ReduceOp.Product: "prod",
            ReduceOp.Adasum: "sum"}  # Adasum here only on one rank (the identity); more: AdasumOptimizer
_PS_TAG = 7301  # point-to-point tag of parameter-server gradient messages


def choose_overlap(usable_cores: int, node_cores: int, local_ranks: int, threads: int) -> bool:
    """Whether to all-reduce during backward: only when a core is free for the communication
    thread. With 2 ranks on 2 cores (MLP 10.5M params, `hpctrain bench train`) overlap was
    never faster than starting every bucket in step(): backward itself slowed by the thread
    competing for the same cores (each transfer is a copy done by a CPU). A rank bound to a subset of cores
    needs more cores than its threads; an unbound rank shares the node with the other local
    ranks."""
    if usable_cores < node_cores:  # bound (taskset, --bind-to core, srun --cpu-bind)
        return usable_cores > threads
    return node_cores > local_ranks * threads


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _default_allocator(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device)


def shared_window_allocator(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Bucket buffers in the node's MPI shared window (``comm.shared_buffer``): gradients are
    all-reduced where backward wrote them, with no copy in or out (2–3× MPI's own all-reduce
    at 1–16 MiB on the 2-core machine of docs/performance.md). Collective: every rank allocates the same buckets in plan order."""
    buf = comm.shared_buffer(numel, str(dtype).replace("torch.", "")).tensor()
    buf.zero_()
    return buf


def use_shared_buckets(backend_name: str, strategy: "Strategy", device: torch.device) -> bool:
    """Shared-window buckets by default where they apply: the MPI backend on CPU tensors, several
    ranks, the all-reduce strategy. Across nodes each node's window holds its own ranks' buckets
    (the hierarchical path reduces them in place; 2 x 2 namespace nodes: the bench MLP's 42 MB
    of gradients all-reduced in 49-69 ms against 70-97 ms private, docs/torch.md).
    The same on every rank. HPCTRAIN_SHARED_BUCKETS=0 turns them off."""
    if not settings.rc.shared_buckets:
        return False
    return (backend_name == "mpi" and device.type == "cpu" and isinstance(strategy, AllReduce)
            and comm.size() > 1)


def _process_set_group(process_set: Any) -> Optional["comm.Group"]:
    """The communicator of ``process_set`` (None: the world)."""
    if process_set is None:
        return None
    if isinstance(process_set, ProcessSet):
        return process_set._resolve()  # None for the global set; clear error if unregistered / not a member
    if isinstance(process_set, comm.Group):
        return process_set
    raise TypeError(f"process_set must be an hvd.ProcessSet or an hpctrain.comm.Group, got "
                    f"{type(process_set).__name__}")


def _is_adasum(op: Any) -> bool:
    try:
        return op is not None and int(op) == ReduceOp.Adasum
    except (TypeError, ValueError):
        return False


class _BucketState:
    __slots__ = ("pending", "launched", "work", "wire", "ctx")

    def __init__(self, size: int) -> None:
        self.pending = size      # parameters of this bucket not yet ready this round
        self.launched = False
        self.work: Any = None
        self.wire: Optional[torch.Tensor] = None
        self.ctx: Any = None


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Arguments follow Horovod's ``hvd.DistributedOptimizer``:

    - ``named_parameters``: ``model.named_parameters()``; names are used to check that every
      rank has the same parameters and in error messages. Default: ``allreduce.noname.<group>.<i>``.
    - ``compression``: ``Compression.none`` (default), ``.fp16`` or ``.bf16`` on the wire.
    - ``backward_passes_per_step``: backward passes summed locally before each all-reduce.
    - ``op``: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``, ``Adasum`` (on more
      than one rank an ``AdasumOptimizer``: each rank steps, the weight deltas are combined).
    - ``gradient_predivide_factor``: with ``op=Average``, divide by this before the sum and by
      ``size/factor`` after it (helps fp16 range).
    - ``groups``: an int (split the parameters into that many fused groups) or lists of
      parameters, each reduced as one unit; default: fuse by ``HPCTRAIN_FUSION_THRESHOLD`` bytes.
    - ``sparse_as_dense``: False (default): sparse gradients (``nn.Embedding(sparse=True)``)
      stay sparse; their indices and values are allgathered, as in Horovod. True: they are
      made dense and all-reduced with the other gradients, then made sparse again before the
      update, as in Horovod (so the wrapped optimizer must accept sparse gradients: SparseAdam).
    - ``process_set``: average over these ranks only (default: all). A registered
      ``hvd.ProcessSet`` (``hvd.add_process_set``) or an ``hpctrain.comm.Group`` (``comm.split``,
      ``comm.new_group``); only its members create the optimizer, and they must agree on it.
      ``sync="parameter_server:R"``: R is a rank of the set. Needs ``backend="mpi"``.

    hpctrain additions (keywords):

    - ``sync``: ``"allreduce"`` (default), ``"parameter_server[:rank]"``, ``"model_average[:K]"``
      or a strategy object from :mod:`hpctrain.torch.strategies`.
    - ``backend``: ``"mpi"`` (default), ``"gloo"``, ``"nccl"``, ``"horovod"`` — who moves the buckets.
    - ``fusion_threshold``: bucket size in bytes (overrides the environment).
    - ``bucket_allocator``: where bucket buffers live (e.g. a shared-memory window).
    - ``overlap``: True starts a bucket's all-reduce during backward as soon as it is full;
      False starts all of them in ``step()``. Default (or ``HPCTRAIN_OVERLAP``): True only
      when a core is free for the communication thread (:func:`choose_overlap`).

    The returned object is a ``torch.optim.Optimizer``: ``param_groups``, ``state``,
    ``state_dict()``, LR schedulers work as on the wrapped optimizer (which it shares).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "DistributedOptimizer":
        # Horovod returns its delta optimizer for op=Adasum on more than one rank.
        if cls is DistributedOptimizer and _is_adasum(kwargs.get("op", args[4] if len(args) > 4 else None)) \
                and comm.is_initialized() and comm.size() > 1:
            from .adasum_optimizer import AdasumOptimizer

            cls = AdasumOptimizer
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
        compression: Any = Compression.none,
        backward_passes_per_step: int = 1,
        op: int = ReduceOp.Average,
        gradient_predivide_factor: float = 1.0,
        groups: Optional[Union[int, Sequence[Sequence[torch.Tensor]]]] = None,
        sparse_as_dense: bool = False,
        *,
        sync: Union[str, Strategy, None] = "allreduce",
        backend: Optional[str] = None,
        fusion_threshold: Optional[int] = None,
        bucket_allocator: Optional[Allocator] = None,
        overlap: Optional[bool] = None,
        process_set: Union[ProcessSet, "comm.Group", None] = global_process_set,
    ) -> None:
        # Deliberately not calling Optimizer.__init__: we wrap the user's optimizer (sharing its
        # param_groups and state) instead of building a second one.
        _require_init("hvd.DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
        self._inner = optimizer
        # The ranks that average together. Resolved before any communication: a set that is not
        # registered fails on every rank alike, and a non-member has no one to agree with.
        self._group = _process_set_group(process_set)
        self._rank, self._size = ((comm.rank(), comm.size()) if self._group is None
                                  else (self._group.rank, self._group.size))
        backend_name = (backend or settings.rc.backend).lower()
        # Validate locally, then agree: a rank that rejects its arguments must not leave the
        # others waiting in the next collective, so every rank learns every rank's verdict.
        local_error, specs, threshold, group_indices = self._check_arguments(
            named_parameters, op, gradient_predivide_factor, backward_passes_per_step, backend_name, sync,
            fusion_threshold, groups)
        self._predivide = float(gradient_predivide_factor)
        self.backward_passes_per_step = max(1, int(backward_passes_per_step))
        self._compression = compression
        self.sparse_as_dense = bool(sparse_as_dense)
        self._verify_across_ranks(local_error, specs, threshold, group_indices, backend_name, sync)
        self._backend: Backend = get_backend(backend_name) if self._group is None else MPIBackend(self._group)
        self.plan = bk.plan_buckets(specs, threshold, group_indices)

        self._allocate_buckets(bucket_allocator, backend_name)
        self._init_step_state(overlap)
        if isinstance(self._strategy, AllReduce) and not self._passthrough:
            self._register_hooks()
        self._rebuild_args = (bucket_allocator, backend_name, overlap)
        #: whether this optimizer follows a re-formed world (elastic jobs); a caller that builds
        #: a new optimizer after a re-forming (the training runner) turns it off on the old one
        self.follow_reforms = True
        if self._group is None and settings.rc.elastic:  # the world's optimizer follows a re-formed world
            comm.on_reform(self._on_reform)
        if self._rank == 0:
            log.info("DistributedOptimizer: %d parameters in %d buckets (threshold %d bytes), sync=%s, backend=%s, "
                     "overlap=%s", len(self._params), len(self.plan.buckets), threshold, self._strategy.name,
                     self._backend.name, self._overlap)

    def _check_arguments(self, named_parameters, op, gradient_predivide_factor, backward_passes_per_step,
                         backend_name: str, sync, fusion_threshold, groups):
        """This rank's verdict on its arguments, without communicating: (the error or None, the
        parameter specs, the fusion threshold, the explicit groups). Sets what it resolves
        (``_op``, ``_strategy``, ``_params``, ``_names``)."""
        specs: List[bk.ParamSpec] = []
        threshold = 0
        group_indices: Optional[List[List[int]]] = None
        try:
            self._op = _resolve_op(None, op)
            if gradient_predivide_factor != 1.0 and self._op != ReduceOp.Average:
                raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} is only supported with "
                                 f"op=Average, got op={self._op.name}")
            if gradient_predivide_factor <= 0:
                raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor}: expected a positive number")
            if int(backward_passes_per_step) < 1:
                raise ValueError(f"backward_passes_per_step={backward_passes_per_step}: expected an integer >= 1")
            if self._group is not None and backend_name != "mpi":
                raise ValueError(f"process_set with backend={backend_name!r} is not supported; only the 'mpi' backend "
                                 "reduces over a subset of ranks.\nHINT: use backend='mpi' (the default)")
            self._strategy: Strategy = parse_sync(sync)
            if isinstance(self._strategy, ParameterServer) and not 0 <= self._strategy.server_rank < self._size:
                raise ValueError(f"parameter_server server_rank={self._strategy.server_rank} but there are only "
                                 f"{self._size} ranks")
            self._params, self._names = self._collect(named_parameters)
            specs = [bk.ParamSpec(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._names, self._params)]
            threshold = bk.fusion_threshold_from_env() if fusion_threshold is None else int(fusion_threshold)
            group_indices = self._group_indices(groups)
        except (ValueError, TypeError, NotImplementedError) as exc:
            return exc, specs, threshold, group_indices
        return None, specs, threshold, group_indices

    def _allocate_buckets(self, bucket_allocator: Optional[Allocator], backend_name: str) -> None:
        """One flat buffer per planned bucket; every parameter's ``.grad`` becomes a view into
        its bucket (an existing gradient is copied in)."""
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}; "
                             "DistributedOptimizer expects one device per rank.\n"
                             "HINT: move the model with model.to(device) before creating the optimizer")
        self._device = devices.pop() if devices else torch.device("cpu")
        if (bucket_allocator is None and self._group is None
                and use_shared_buckets(backend_name, self._strategy, self._device)):
            bucket_allocator = shared_window_allocator
        allocate = bucket_allocator or _default_allocator
        self._shared = allocate is shared_window_allocator
        self._buffers: List[torch.Tensor] = []
        self._views: List[Optional[torch.Tensor]] = [None] * len(self._params)
        for bucket in self.plan.buckets:
            dtype = self._params[bucket.slots[0].index].dtype
            buf = allocate(bucket.numel, dtype, self._device)
            if buf.shape != (bucket.numel,) or buf.dtype != dtype or not buf.is_contiguous():
                raise ValueError(f"bucket_allocator returned {tuple(buf.shape)} {buf.dtype}; expected a "
                                 f"contiguous 1-D tensor of {bucket.numel} {dtype}")
            if bucket_allocator is not None:
                buf.zero_()  # parameters without a gradient yet read zeros from their view
            self._buffers.append(buf)
            for slot in bucket.slots:
                view = buf[slot.offset:slot.offset + slot.numel].view(slot.shape)
                self._views[slot.index] = view
                p = self._params[slot.index]
                if p.grad is not None:
                    view.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
                p.grad = view


    def _init_step_state(self, overlap: Optional[bool]) -> None:
        """Per-round bookkeeping, the overlap choice, and how Average is applied."""
        self._lock = threading.RLock()
        self._states = [_BucketState(len(b.slots)) for b in self.plan.buckets]
        self._delay = [self.backward_passes_per_step] * len(self._params)
        self._next_launch = 0
        self._should_synchronize = True
        self._synchronized = False
        self._no_sync_depth = 0
        self._hook_handles: List[Any] = []
        if overlap is None:
            env = settings.rc.overlap
            overlap = env if env is not None else choose_overlap(_usable_cores(), os.cpu_count() or 1,
                                                                 comm.local_size(), torch.get_num_threads())
        self._overlap = bool(overlap)
        self._ma_samples = 0.0
        self._ma_steps = 0
        #: seconds spent waiting for communication in synchronize(), summed (for benchmarks)
        self.wait_seconds = 0.0
        # One rank, nothing to reduce (Average/Sum over one rank is the identity, and no wire
        # format rounds the values): gradients stay where autograd put them, no hooks, no
        # copies — the same cost as a plain PyTorch loop.
        self._passthrough = (self._size == 1 and isinstance(self._strategy, AllReduce)
                             and self._op in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum)
                             and self._predivide == 1.0
                             and getattr(self._compression, "wire_dtype", None) is None)
        # Average as "pre-divide, then sum": the hook that moves a fresh gradient into its bucket
        # multiplies by 1/size on the way (one pass, the cost of the copy it replaces), so the
        # all-reduce is a plain sum with no averaging pass over the result (it saves a 21 MB pass
        # per rank per step for the 10.5M-parameter MLP at 2 ranks). Floating buckets only
        # (integers would truncate), and not with compression or gradient_predivide_factor
        # (their own scaling applies). Decided from options every rank shares, so every rank
        # submits the same op.
        prescale = (isinstance(self._strategy, AllReduce) and self._size > 1 and self._op == ReduceOp.Average
                    and self._predivide == 1.0 and self._compression in (Compression.none, NoneCompressor))
        self._bucket_scale: List[Optional[float]] = [
            1.0 / self._size if prescale and buf.dtype.is_floating_point else None for buf in self._buffers]
        self._slot_scale: List[Optional[float]] = [None] * len(self._params)
        for b, bucket in enumerate(self.plan.buckets):
            for slot in bucket.slots:
                self._slot_scale[slot.index] = self._bucket_scale[b]
        self._adopted = [False] * len(self._params)  # gradient already in its slot this round
        self._sparse_grads: Dict[int, torch.Tensor] = {}  # sparse gradients of this round (Horovod's path)
        self._densified: Dict[int, int] = {}  # sparse_as_dense: parameter -> its gradient's sparse_dim

    # ------------------------------------------------------------------ Optimizer surface
    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's parameter groups (shared)."""
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's state (shared)."""
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's defaults."""
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: Dict[str, Any]) -> None:
        self._inner.defaults = value

    @property
    def bucket_buffers(self) -> List[torch.Tensor]:
        """The flat bucket buffers, in communication order (``.grad`` of each parameter is a
        view into one of them; see ``plan`` for who is where)."""
        return list(self._buffers)

    @property
    def bucket_ops(self) -> List[str]:
        """The reduction each bucket's all-reduce uses on the wire ("sum" for an averaged floating
        bucket: its gradients were divided by the rank count on their way in)."""
        return [self._wire_op(b) for b in range(len(self._buffers))]

    @property
    def shared_buckets(self) -> bool:
        """Whether the buckets live in the node's shared window (zero-copy all-reduce)."""
        return self._shared

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: fall through to the wrapped optimizer.
        inner = self.__dict__.get("_inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._inner!r}, sync={self._strategy.name}, buckets={len(self._buffers)})"

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict."""
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """Load into the wrapped optimizer."""
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:  # type: ignore[override]
        """Not supported after wrapping: the bucket plan is fixed at construction."""
        raise NotImplementedError("add_param_group() after wrapping is not supported: buckets are planned once.\n"
                                  "HINT: add every parameter group before creating the DistributedOptimizer")

    # ------------------------------------------------------------------ construction helpers
    def _collect(self, named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]]
                 ) -> Tuple[List[torch.Tensor], List[str]]:
        in_optimizer: List[torch.Tensor] = []
        seen: set = set()
        default_names: Dict[int, str] = {}
        for gi, group in enumerate(self._inner.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in seen:
                    seen.add(id(p))
                    in_optimizer.append(p)
                    default_names[id(p)] = f"allreduce.noname.{gi}.{pi}"
        if named_parameters is None:
            ordered = [(default_names[id(p)], p) for p in in_optimizer]
        else:
            named = list(named_parameters)
            for item in named:
                if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                    raise ValueError(f"named_parameters must be (name, tensor) pairs such as model.named_parameters(); "
                                     f"got an item of type {type(item).__name__}")
            names = [n for n, _ in named]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {dupes}\n"
                                 "HINT: pass model.named_parameters() of one model, or prefix the names of each "
                                 "sub-model")
            by_id = {id(p): n for n, p in named}
            missing = [p for p in in_optimizer if id(p) not in by_id]
            if missing:
                desc = ", ".join(f"{default_names[id(p)]} shape {tuple(p.shape)}" for p in missing[:5])
                raise ValueError(f"named_parameters was specified, but {len(missing)} of the optimizer's parameters "
                                 f"are not in it ({desc}{', ...' if len(missing) > 5 else ''}).\n"
                                 "HINT: pass the named_parameters() of the model whose parameters the optimizer "
                                 "updates (all of them)")
            # Registration order = order of named_parameters (the model's order).
            ordered = [(n, p) for n, p in named if id(p) in seen]
            uniq: Dict[int, Tuple[str, torch.Tensor]] = {}
            for n, p in ordered:
                uniq.setdefault(id(p), (n, p))
            ordered = list(uniq.values())
        ordered = [(n, p) for n, p in ordered if p.requires_grad]
        return [p for _, p in ordered], [n for n, _ in ordered]

    def _group_indices(self, groups: Any) -> Optional[List[List[int]]]:
        if groups is None:
            return None
        if isinstance(groups, int):
            if groups <= 0:
                raise ValueError(f"groups={groups}: expected a positive number of groups")
            order = list(range(len(self._params) - 1, -1, -1))
            return [[order[i] for i in r] for r in bk.split_into_groups(len(order), groups)]
        index = {id(p): i for i, p in enumerate(self._params)}
        out = []
        for g, members in enumerate(groups):
            idx = []
            for p in members:
                if id(p) not in index:
                    raise ValueError(f"groups[{g}] holds a tensor of shape {tuple(p.shape)} that is not a "
                                     "parameter of the optimizer (or does not require grad)")
                idx.append(index[id(p)])
            out.append(idx)
        return out

    def _verify_across_ranks(self, local_error: Optional[BaseException], specs: List[bk.ParamSpec], threshold: int,
                             groups: Optional[List[List[int]]], backend: str, sync: Any) -> None:
        """Every rank must accept its arguments and plan the same buckets: one all-gather of
        (error, digest of names/shapes/dtypes, options); a clear error on every rank otherwise."""
        error = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
        options = None
        if local_error is None:
            options = repr((self._strategy, self._op.name, getattr(self._compression, "__name__", str(self._compression)),
                            self.backward_passes_per_step, self._predivide, threshold, groups, backend,
                            None if self._group is None else self._group.ranks))
        mine = (error, bk.specs_digest(specs), options)
        everyone = comm.allgather_object(mine, group=self._group)
        if local_error is not None:
            raise local_error
        failed = [(r, e[0]) for r, e in enumerate(everyone) if e[0] is not None]
        if failed:
            r, msg = failed[0]
            raise ValueError(f"DistributedOptimizer: rank {r} rejected its arguments ({msg}); no rank can continue.\n"
                             "HINT: fix the arguments on that rank; every rank must create the optimizer the same way")
        if any(e[1] != everyone[0][1] for e in everyone):
            all_specs = comm.allgather_object(specs, group=self._group)
            why = bk.describe_spec_mismatch(all_specs) or "parameter lists differ"
            raise ValueError(
                f"DistributedOptimizer: the ranks do not have the same parameters: {why}.\n"
                "Gradients of different shapes cannot be all-reduced together.\n"
                "HINT: build the same model on every rank (same architecture, same order); create rank-specific "
                "layers outside the optimizer")
        if any(e[2] != everyone[0][2] for e in everyone):
            opts = {r: e[2] for r, e in enumerate(everyone)}
            raise ValueError(f"DistributedOptimizer: ranks were created with different options: {opts}.\n"
                             "HINT: pass the same op, compression, sync, backend, groups and "
                             "HPCTRAIN_FUSION_THRESHOLD on every rank")

    def _on_reform(self) -> None:
        """The world was re-formed (an elastic job lost ranks): take the new rank and size,
        allocate fresh buckets on the new world (the old shared window belongs to a group that
        is gone) and forget the step in flight. Its gradients are dropped: the elastic state
        restores the last commit and the step runs again."""
        if not self.follow_reforms:
            return
        bucket_allocator, backend_name, overlap = self._rebuild_args
        if backend_name != "mpi":
            raise comm.ElasticError(f"DistributedOptimizer(backend={backend_name!r}) cannot follow a re-formed "
                                    "world (torch.distributed's process group is fixed).\nHINT: use backend='mpi' "
                                    "(the default) in elastic jobs")
        with self._lock:
            self._rank, self._size = comm.rank(), comm.size()
            self._backend = get_backend(backend_name)
            for p in self._params:
                p.grad = None  # the failed step's partial gradients
            hooks = self._hook_handles
            self._allocate_buckets(bucket_allocator, backend_name)
            self._init_step_state(overlap)
            self._hook_handles = hooks
            if hooks:
                self._passthrough = False  # the hooks stay attached, and they fill buckets

    # ------------------------------------------------------------------ hooks and buckets
    def _register_hooks(self) -> None:
        for i, p in enumerate(self._params):
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if self._no_sync_depth:
                return
            with self._lock:
                b, _ = self.plan.locate(i)
                if self._delay[i] <= 0:
                    name = self._names[i]
                    raise AssertionError(
                        f"Gradients were computed more than backward_passes_per_step="
                        f"{self.backward_passes_per_step} times before call to step() (parameter {name!r}).\n"
                        "HINT: increase backward_passes_per_step to accumulate gradients locally, or wrap the "
                        "extra backward passes in optimizer.no_sync()")
                self._delay[i] -= 1
                if self._delay[i] > 0:
                    return
                self._adopt_grad(i)
                state = self._states[b]
                state.pending -= 1
                if state.pending == 0 and self._overlap:
                    self._launch_ready()

        return hook

    def _adopt_grad(self, i: int) -> None:
        """Put parameter i's gradient of this round into its bucket slot, once per round:
        a fresh tensor is copied in (multiplied by the bucket's pre-division factor on the way),
        a gradient autograd accumulated in the slot itself is scaled in place, no gradient gives
        zeros (another rank may have one). Afterwards ``.grad`` is the slot view."""
        if self._adopted[i]:
            return
        self._adopted[i] = True
        p, view = self._params[i], self._views[i]
        scale = self._slot_scale[i]
        g = p.grad
        if g is None:
            view.zero_()  # no gradient on this rank: contribute zeros (another rank may have one)
        elif g.is_sparse and not self.sparse_as_dense and isinstance(self._strategy, AllReduce):
            # Horovod's sparse path: the gradient stays sparse and is allgathered in
            # synchronize(); its bucket slot carries zeros.
            view.zero_()
            self._sparse_grads[i] = g
            return
        else:
            if g.is_sparse:  # sparse_as_dense: dense for the all-reduce only, sparse again after it
                self._densified[i] = g.sparse_dim()
                g = g.to_dense()
            if g is view or (g.data_ptr() == view.data_ptr() and g.shape == view.shape):
                if scale is not None:  # zero_grad(set_to_none=False): autograd added into the slot
                    view.mul_(scale)
            elif scale is None:
                # A fresh tensor: zero_grad(set_to_none=True) on the optimizer or the model.
                view.copy_(g)
            else:
                torch.mul(g, scale, out=view)
        p.grad = view

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._states) and self._states[self._next_launch].pending <= 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b: int) -> None:
        state = self._states[b]
        buf = self._buffers[b]
        wire, ctx = self._compression.compress(buf)
        if self._predivide != 1.0:
            wire.mul_(1.0 / self._predivide)
        op = self._wire_op(b)
        state.wire, state.ctx = wire.contiguous(), ctx
        state.work = self._backend.allreduce_async(state.wire, op, name=f"hpctrain.bucket.{b}")
        state.launched = True

    def _wire_op(self, b: int) -> str:
        if self._predivide != 1.0 or self._bucket_scale[b] is not None:
            return "sum"  # divided before the sum (predivide factor, or by size on the way in)
        return _COMM_OP[self._op]

    def _finish(self, b: int) -> None:
        state = self._states[b]
        t0 = time.perf_counter()
        state.work.wait()
        self.wait_seconds += time.perf_counter() - t0
        buf = self._buffers[b]
        if state.wire is not buf:
            buf.copy_(self._compression.decompress(state.wire, state.ctx))
        if self._predivide != 1.0:
            buf.mul_(self._predivide / self._size)

    def _reduce_sparse(self) -> None:
        """Allgather the indices and values of each sparse gradient (parameter order, the same
        on every rank, after every bucket): duplicates add up; Average divides by the size."""
        for i in sorted(self._sparse_grads):
            g = self._sparse_grads[i]
            indices = comm.allgather(g._indices().transpose(0, 1).contiguous(), group=self._group)
            values = comm.allgather(g._values().contiguous(), group=self._group)
            if self._op == ReduceOp.Average:
                values = values / self._size
            self._params[i].grad = torch.sparse_coo_tensor(indices.transpose(0, 1), values, g.size())
        self._sparse_grads = {}

    def _reset_round(self) -> None:
        for b, bucket in enumerate(self.plan.buckets):
            self._states[b] = _BucketState(len(bucket.slots))
        self._delay = [self.backward_passes_per_step] * len(self._params)
        self._next_launch = 0
        self._adopted = [False] * len(self._params)

    # ------------------------------------------------------------------ public API
    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before each all-reduce."""
        if int(passes) < 1:
            raise ValueError(f"backward_passes_per_step={passes}: expected an integer >= 1")
        with self._lock:
            self.backward_passes_per_step = int(passes)
            self._delay = [self.backward_passes_per_step] * len(self._params)

    def synchronize(self) -> None:
        """Finish the gradient communication of this step (all buckets), without stepping."""
        self._check_alive("synchronize()")
        if self._passthrough:
            pass
        elif isinstance(self._strategy, AllReduce):
            with self._lock:
                # Start, in plan order, every bucket the hooks did not start: same order on
                # every rank; parameters without a gradient here contribute zeros.
                for b in range(self._next_launch, len(self._states)):
                    for slot in self.plan.buckets[b].slots:
                        self._adopt_grad(slot.index)
                    self._states[b].pending = 0
                self._launch_ready()
                for b in range(len(self._states)):
                    self._finish(b)
                self._reduce_sparse()
                # As Horovod: the optimizer sees the averaged gradient as sparse again (so it
                # needs a sparse-capable optimizer such as SparseAdam, as without the option).
                for i, sparse_dim in self._densified.items():
                    self._params[i].grad = self._views[i].to_sparse(sparse_dim)
                self._densified = {}
                self._reset_round()
        elif isinstance(self._strategy, ParameterServer):
            self._reduce_to_server()
            self._adopted = [False] * len(self._params)
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context ``step()`` does not synchronize (call ``synchronize()`` yourself,
        e.g. to clip gradients between the two)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context only accumulate gradients locally; the first
        backward pass after it communicates the accumulated sum."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """Reset the gradients, as ``torch.optim.Optimizer.zero_grad``.

        ``set_to_none=True`` (default): ``.grad`` becomes None; the next backward pass creates
        fresh gradients and the hooks copy each into its bucket (one copy, measured cheaper
        than zeroing the buckets and accumulating into them). ``set_to_none=False``: the
        buckets are zeroed in place and gradients accumulate straight into them.
        """
        started = any(d < self.backward_passes_per_step for d in self._delay)  # hooks counted a pass
        if isinstance(self._strategy, AllReduce) and (started or any(st.launched for st in self._states)):
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition.\n"
                "HINT: call optimizer.step() first, or zero_grad() before the backward pass")
        if self._passthrough:
            self._inner.zero_grad(set_to_none)
            return
        if set_to_none:
            for p in self._params:
                p.grad = None
            return
        for buf in self._buffers:
            buf.zero_()
        for i, p in enumerate(self._params):
            if p.grad is not None and p.grad.is_sparse:
                p.grad = None  # the next backward pass makes a fresh sparse gradient
            elif p.grad is not self._views[i]:
                p.grad = self._views[i]

    def step(self, closure: Optional[Callable[[], float]] = None, *, num_samples: Optional[float] = None) -> Any:
        """Synchronize (unless inside ``skip_synchronize()``), then step the wrapped optimizer.

        ``num_samples`` (model_average only): samples this rank processed in this step, the
        weight of its model at the next merge (default 1 per step).
        """
        self._check_alive("step()")
        if isinstance(self._strategy, ModelAverage):
            loss = self._inner.step(closure)
            self._ma_samples += 1.0 if num_samples is None else float(num_samples)
            self._ma_steps += 1
            if self._ma_steps % self._strategy.every == 0:
                self.merge()
            return loss
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.")
            self.synchronize()
        self._synchronized = False
        if isinstance(self._strategy, ParameterServer):
            loss = None
            if self._rank == self._strategy.server_rank:
                loss = self._inner.step(closure)
            self._broadcast_params(self._strategy.server_rank)
            return loss
        return self._inner.step(closure)

    def merge(self) -> None:
        """model_average: replace every rank's weights by their sample-weighted average now."""
        self._check_alive("merge()")
        total = comm.allreduce(torch.tensor([self._ma_samples], dtype=torch.float64), op="sum", group=self._group)
        weight = self._ma_samples / float(total[0]) if float(total[0]) > 0 else 1.0 / self._size
        with torch.no_grad():
            for flat, members in self._flat_params():
                scaled = flat.double().mul_(weight) if flat.dtype != torch.float64 else flat.mul(weight)
                comm.allreduce_(scaled, op="sum", group=self._group)
                self._unflatten_into(scaled.to(flat.dtype), members)
        self._ma_samples = 0.0

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer then only communicates in synchronize())."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()

    # ------------------------------------------------------------------ strategies' data movement
    def _check_alive(self, what: str) -> None:
        if not comm.is_initialized():
            raise HpctrainNotInitialized(
                f"DistributedOptimizer.{what}: hpctrain.torch is not initialized (hvd.init() was not called, "
                "or hvd.shutdown() already was).\nHINT: call hvd.init() before training and hvd.shutdown() "
                "only after the last step")

    def _flat_params(self) -> List[Tuple[torch.Tensor, List[int]]]:
        """Parameters flattened into one buffer per dtype, in registration order."""
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, p in enumerate(self._params):
            by_dtype.setdefault(p.dtype, []).append(i)
        out = []
        for dtype, members in by_dtype.items():
            out.append((torch.cat([self._params[i].detach().reshape(-1) for i in members]), members))
        return out

    def _unflatten_into(self, flat: torch.Tensor, members: List[int]) -> None:
        offset = 0
        for i in members:
            p = self._params[i]
            n = p.numel()
            p.data.copy_(flat[offset:offset + n].view(p.shape))
            offset += n

    def _reduce_to_server(self) -> None:
        """parameter_server: every rank's buckets go to the server, which reduces them."""
        server = self._strategy.server_rank  # type: ignore[union-attr]
        for i in range(len(self._params)):
            self._adopt_grad(i)
        op = self._op
        for b, buf in enumerate(self._buffers):
            host = buf if buf.device.type == "cpu" else buf.cpu()
            if self._rank == server:
                acc = host.double() if host.dtype in (torch.float16, torch.bfloat16) else host.clone()
                scratch = torch.empty_like(host)
                for r in range(self._size):
                    if r == server:
                        continue
                    comm.recv(scratch, source=r, tag=_PS_TAG, group=self._group)
                    other = scratch.to(acc.dtype)
                    if op in (ReduceOp.Average, ReduceOp.Sum):
                        acc += other
                    elif op == ReduceOp.Min:
                        torch.minimum(acc, other, out=acc)
                    elif op == ReduceOp.Max:
                        torch.maximum(acc, other, out=acc)
                    else:
                        acc *= other
                if op == ReduceOp.Average:
                    acc /= self._size
                buf.copy_(acc)
            else:
                comm.send(host.contiguous(), dest=server, tag=_PS_TAG, group=self._group)

    def _broadcast_params(self, root: int) -> None:
        with torch.no_grad():
            for flat, members in self._flat_params():
                self._backend.broadcast_(flat, root)
                self._unflatten_into(flat, members)
