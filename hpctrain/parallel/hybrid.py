"""Hybrid data × pipeline parallelism: world = DP × PP.

Layout (a pure plan, :class:`HybridLayout`): world rank ``r = stage · DP + d``. The DP ranks of
one stage are neighbours (same node when DP ≤ ranks per node), because the data-parallel
all-reduce of a stage's gradients moves far more bytes than the activations between stages.

- pipeline group of replica d: world ranks ``d, DP+d, 2·DP+d, …`` — its group rank is the stage;
- data-parallel group of stage s: world ranks ``s·DP … s·DP+DP−1``.

:func:`make_groups` creates both with ``comm.split`` (after :meth:`HybridLayout.build` has
validated the sizes — errors come before any communication). :func:`distributed_optimizer`
averages each stage's gradients over its data-parallel group: with hpctrain.torch's
``DistributedOptimizer`` when it accepts a group, otherwise with :class:`GroupAveragingOptimizer`
(one ``comm.allreduce(op="avg", group=dp_group)`` of the flattened gradients per step).
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from hpctrain import comm

log = logging.getLogger("hpctrain.parallel")


@dataclass(frozen=True)
class HybridLayout:
    """Which stage and data-parallel replica each world rank is."""

    world_size: int
    stages: int

    def __post_init__(self) -> None:
        check_world(self.world_size, self.stages)

    @classmethod
    def build(cls, world_size: int, stages: int) -> "HybridLayout":
        return cls(world_size, stages)

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.stages

    def stage_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.data_parallel

    def replica_of(self, rank: int) -> int:
        """Data-parallel index (which pipeline replica) of ``rank``."""
        self._check_rank(rank)
        return rank % self.data_parallel

    def rank_of(self, stage: int, replica: int) -> int:
        if not 0 <= stage < self.stages or not 0 <= replica < self.data_parallel:
            raise ValueError(f"no rank for stage {stage}, replica {replica} in a {self.data_parallel}×{self.stages} layout")
        return stage * self.data_parallel + replica

    def pipeline_ranks(self, replica: int) -> Tuple[int, ...]:
        """World ranks of replica ``replica``'s pipeline, in stage order."""
        return tuple(self.rank_of(s, replica) for s in range(self.stages))

    def data_parallel_ranks(self, stage: int) -> Tuple[int, ...]:
        """World ranks holding stage ``stage``, in replica order."""
        return tuple(self.rank_of(stage, d) for d in range(self.data_parallel))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, {self.world_size})")


def check_world(world_size: int, stages: int) -> None:
    """Raise a clear ValueError unless ``world_size`` ranks can run ``stages`` stages."""
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"pipeline stages must be an integer ≥ 1, got {stages!r}")
    if stages > world_size:
        raise ValueError(
            f"{stages} pipeline stages need at least {stages} ranks (one per stage), but the job has {world_size}.\n"
            f"HINT: launch with a multiple of {stages} ranks (e.g. mpiexec -n {stages}), or use fewer stages")
    if world_size % stages:
        raise ValueError(
            f"world size {world_size} is not divisible by the {stages} pipeline stages: every data-parallel "
            f"replica needs a full pipeline.\nHINT: launch with a multiple of {stages} ranks "
            f"(e.g. {stages * max(1, world_size // stages)} or {stages * (world_size // stages + 1)}), or choose "
            f"stages dividing {world_size}")


@dataclass
class HybridGroups:
    """This rank's place in the DP × PP layout and its two groups."""

    layout: HybridLayout
    stage: int
    replica: int
    pipeline_group: Any  # comm.Group; group rank == stage
    data_parallel_group: Any  # comm.Group; group rank == replica


def make_groups(stages: int, layout: Optional[HybridLayout] = None) -> HybridGroups:
    """Split the world into pipeline groups and data-parallel groups (every rank calls this).

    Validates first (no communication on bad input)."""
    layout = layout or HybridLayout.build(comm.size(), stages)
    r = comm.rank()
    stage, replica = layout.stage_of(r), layout.replica_of(r)
    pipe = comm.split(color=replica, key=stage)
    dp = comm.split(color=stage, key=replica)
    assert pipe.rank == stage and dp.rank == replica, (pipe.rank, stage, dp.rank, replica)
    return HybridGroups(layout, stage, replica, pipe, dp)


# --------------------------------------------------------------------------- gradient averaging
def average_gradients(params: Iterable[torch.Tensor], group: Any) -> None:
    """Average ``.grad`` of ``params`` over ``group`` with one fused all-reduce per dtype.

    Every rank of the group must pass the same parameters in the same order; a missing
    gradient counts as zeros (another replica may have one)."""
    params = [p for p in params if p.requires_grad]
    if group is None or group.size == 1 or not params:
        return
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        members = by_dtype[dtype]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).cpu()
                          for p in members])
        comm.allreduce_(flat, op="avg", group=group)
        offset = 0
        for p in members:
            n = p.numel()
            chunk = flat[offset:offset + n].view_as(p).to(p.device)
            if p.grad is None:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)
            offset += n


class GroupAveragingOptimizer:
    """Wraps a torch optimizer: ``step()`` first averages the gradients over ``group``.

    Used when hpctrain.torch's ``DistributedOptimizer`` takes no group argument. Gradients of
    all micro-batches are already summed locally by the pipeline, so one all-reduce per step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: Any) -> None:
        self.optimizer = optimizer
        self.group = group

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def _params(self) -> List[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def synchronize(self) -> None:
        """Average the gradients now (``step()`` does it too)."""
        average_gradients(self._params(), self.group)
        self._synced = True

    def step(self, closure: Optional[Callable[[], float]] = None) -> Any:
        if not getattr(self, "_synced", False):
            self.synchronize()
        self._synced = False
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"GroupAveragingOptimizer({self.optimizer!r}, group={self.group!r})"


def _group_keyword() -> Optional[str]:
    """How hpctrain.torch.DistributedOptimizer takes a subset of ranks, if it does:
    'group' / 'comm_group' (an hpctrain.comm Group) or 'process_set' (a Horovod ProcessSet)."""
    try:
        from hpctrain.torch import DistributedOptimizer
    except ImportError:  # pragma: no cover - hpctrain.torch is part of the package
        return None
    params = inspect.signature(DistributedOptimizer.__init__).parameters
    for name in ("group", "comm_group", "process_set"):
        if name in params:
            return name
    return None


def _process_set(pipe: Any) -> Any:
    """The Horovod process set of this stage's data-parallel ranks. Every rank registers the
    sets of all stages, in stage order (add_process_set is collective over the world)."""
    cached = getattr(pipe, "_dp_process_set", None)
    if cached is not None:
        return cached
    layout = getattr(pipe, "layout", None)
    if layout is None:
        raise ValueError("distributed_optimizer with process sets needs the pipeline's DP × PP layout; build the "
                         "PipelineModule with group=None")
    import hpctrain.torch as hvd

    mine = None
    for stage in range(layout.stages):
        ps = hvd.add_process_set(list(layout.data_parallel_ranks(stage)))
        if stage == pipe.stage:
            mine = ps
    pipe._dp_process_set = mine
    return mine


def distributed_optimizer(pipe: Any, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
    """An optimizer whose ``step()`` averages ``pipe``'s stage gradients over its data-parallel
    group, then steps. With one replica (DP = 1) the optimizer is returned unchanged. Every
    rank must call it (it may create communicators).

    Uses ``hpctrain.torch.DistributedOptimizer(…, backward_passes_per_step=micro_batches)`` on
    the data-parallel ranks when it accepts a group or process set; otherwise
    :class:`GroupAveragingOptimizer`. ``kwargs`` go to DistributedOptimizer.
    """
    group = pipe.data_parallel_group
    if group is None or group.size == 1:
        return optimizer
    keyword = _group_keyword()
    if keyword is not None:
        import hpctrain.torch as hvd
        from hpctrain.torch import DistributedOptimizer

        hvd.init()  # idempotent; DistributedOptimizer and process sets require it
        kwargs.setdefault("backward_passes_per_step", pipe.micro_batches)
        kwargs[keyword] = _process_set(pipe) if keyword == "process_set" else group
        return DistributedOptimizer(optimizer, named_parameters=list(pipe.named_parameters()), **kwargs)
    if kwargs:
        raise ValueError(f"options {sorted(kwargs)} need hpctrain.torch.DistributedOptimizer with a group "
                         "argument, which this installation lacks")
    if comm.rank() == 0:
        log.info("pipeline: averaging stage gradients over data-parallel groups of %d with comm.allreduce "
                 "(DistributedOptimizer takes no group)", group.size)
    return GroupAveragingOptimizer(optimizer, group)
