"""Hybrid data × pipeline parallelism: world = DP × PP.

Layout (a pure plan, :class:`HybridLayout`): world rank ``r = stage · DP + d``. The DP ranks of
one stage are neighbours (same node when DP ≤ ranks per node), because the data-parallel
all-reduce of a stage's gradients moves far more bytes than the activations between stages.

- pipeline group of replica d: world ranks ``d, DP+d, 2·DP+d, …`` — its group rank is the stage;
- data-parallel group of stage s: world ranks ``s·DP … s·DP+DP−1``.

:func:`make_groups` creates both with ``comm.split`` (after :meth:`HybridLayout.build` has
validated the sizes — errors come before any communication). :func:`distributed_optimizer`
averages each stage's gradients over its data-parallel group with hpctrain.torch's
``DistributedOptimizer(process_set=dp_group)``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Tuple

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
def distributed_optimizer(pipe: Any, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
    """``hpctrain.torch.DistributedOptimizer`` averaging ``pipe``'s stage gradients over the
    stage's data-parallel group (``process_set=pipe.data_parallel_group``). Every rank calls it;
    the ranks of one data-parallel group agree on the options.

    Defaults: ``backward_passes_per_step=pipe.micro_batches`` (one backward pass per
    micro-batch, all summed locally before one all-reduce per step) and ``overlap=False``
    (the buckets are all-reduced in ``step()``/``synchronize()``, after the schedule's last
    message, so data-parallel traffic never competes with the pipeline's). With one replica
    (DP = 1) the group has one rank and the optimizer is a pass-through. A pipeline built with
    an explicit ``group=`` has no data-parallel group: the optimizer is returned unchanged.
    ``kwargs`` go to DistributedOptimizer (compression, backend="mpi", fusion_threshold, …).
    """
    group = pipe.data_parallel_group
    if group is None:
        return optimizer
    import hpctrain.torch as hvd

    hvd.init()  # idempotent; DistributedOptimizer requires it
    kwargs.setdefault("backward_passes_per_step", pipe.micro_batches)
    kwargs.setdefault("overlap", False)
    kwargs.setdefault("named_parameters", list(pipe.named_parameters()))
    return hvd.DistributedOptimizer(optimizer, process_set=group, **kwargs)
