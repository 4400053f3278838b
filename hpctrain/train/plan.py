"""The training plan: pure arithmetic from the config, the sample counts and the world size.

:func:`make_plan` decides the per-rank data share, steps per epoch, total steps, global batch
and the scaled learning rate; :func:`lr_factor` is the schedule. ``hpctrain train --dry-run``
prints the plan; the trainer only walks it. Unit-tested without MPI or files.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from hpctrain.train.config import ConfigError, ScheduleConfig, TrainConfig


@dataclass(frozen=True)
class TrainPlan:
    """What a run will do. ``steps`` are optimizer steps (each ``accumulation`` batches)."""

    world_size: int
    batch_size: int                 # per rank, per backward pass (the mean under 'weighted')
    rank_batch_sizes: Tuple[int, ...]
    accumulation: int
    global_batch: int               # samples per optimizer step over all ranks
    train_samples: int
    test_samples: int
    rank_samples: Tuple[int, ...]   # real training samples per rank per epoch
    batches_per_epoch: int          # loader steps per epoch (equal on every rank)
    steps_per_epoch: int            # optimizer steps per epoch
    total_steps: int
    epochs: float                   # total_steps / steps_per_epoch
    base_lr: float
    lr: float                       # after lr_scaling
    lr_scaling: str
    policy: str
    weights: Optional[Tuple[float, ...]] = None  # per rank, under the 'weighted' policy

    def __post_init__(self) -> None:
        assert len(self.rank_batch_sizes) == self.world_size == len(self.rank_samples)
        assert self.steps_per_epoch >= 1 and self.total_steps >= 1

    def describe(self) -> str:
        """Human-readable plan (``--dry-run``)."""
        share = ", ".join(f"rank {r}: {n} samples ({b}/batch)" for r, (n, b)
                          in enumerate(zip(self.rank_samples, self.rank_batch_sizes)))
        lines = [
            f"ranks: {self.world_size}",
            f"training samples: {self.train_samples}   test samples: {self.test_samples}",
            f"per-rank data share ({self.policy}): {share}",
            f"batch: {self.batch_size} per rank x {self.world_size} ranks x {self.accumulation} accumulation "
            f"= global batch {self.global_batch}",
            f"steps: {self.steps_per_epoch} per epoch, {self.total_steps} in total ({self.epochs:.2f} epochs)",
            f"learning rate: {self.lr:g} (base {self.base_lr:g}, lr_scaling {self.lr_scaling} over "
            f"{self.world_size * self.accumulation}x the single-rank batch)",
        ]
        return "\n".join(lines)


def scale_lr(base: float, factor: int, rule: str) -> float:
    """``linear``: base x factor (Goyal et al.), ``sqrt``: base x sqrt(factor), ``none``: base."""
    if rule == "linear":
        return base * factor
    if rule == "sqrt":
        return base * math.sqrt(factor)
    return base


def make_plan(cfg: TrainConfig, train_counts: Sequence[int], test_counts: Sequence[int], world_size: int,
              batch_size: Optional[int] = None, weights: Optional[Sequence[float]] = None) -> TrainPlan:
    """Plan a run of ``cfg`` on ``world_size`` ranks over files with ``train_counts`` samples."""
    from hpctrain.data.planner import plan_epoch

    b = int(batch_size if batch_size is not None else cfg.batch_size)  # type: ignore[arg-type]
    if b < 1:
        raise ConfigError(f"batch_size {b} must be >= 1")
    policy = "weighted" if weights is not None else cfg.data.policy
    if policy == "weighted" and weights is None:
        weights = rank_weights(cfg.data.weights, world_size)
    # 'stratified' gives every rank the steps and the number of real samples 'contiguous' gives
    # it (the totals of a round-robin deal); only which samples differs, which needs the labels.
    kwargs = dict(seed=cfg.seed, epoch=0, policy="contiguous" if policy == "stratified" else policy,
                  drop_last=cfg.data.drop_last,
                  shuffle=cfg.data.shuffle, weights=weights if policy == "weighted" else None)
    plans = [plan_epoch(list(train_counts), world_size, r, b, **kwargs) for r in range(world_size)]
    batches = plans[0].steps
    k = cfg.sync.backward_passes_per_step
    spe = batches // k
    if spe < 1:
        raise ConfigError(f"one epoch has {batches} batches per rank, fewer than "
                          f"sync.backward_passes_per_step={k}: no optimizer step would run. "
                          "HINT: lower batch_size or backward_passes_per_step")
    if cfg.steps and cfg.epochs:
        total = min(cfg.steps, cfg.epochs * spe)
    elif cfg.steps:
        total = cfg.steps
    else:
        total = cfg.epochs * spe
    lr = scale_lr(cfg.optimizer.lr, world_size * k, cfg.lr_scaling)
    return TrainPlan(
        world_size=world_size, batch_size=b, rank_batch_sizes=tuple(p.batch_size for p in plans),
        accumulation=k, global_batch=sum(p.batch_size for p in plans) * k,
        train_samples=int(sum(train_counts)), test_samples=int(sum(test_counts)),
        rank_samples=tuple(p.num_real for p in plans), batches_per_epoch=batches, steps_per_epoch=spe,
        total_steps=int(total), epochs=total / spe, base_lr=cfg.optimizer.lr, lr=lr,
        lr_scaling=cfg.lr_scaling, policy=policy,
        weights=tuple(float(w) for w in weights) if policy == "weighted" else None,  # type: ignore[union-attr]
    )


def rank_weights(weights: Sequence[float], world_size: int, node_of_rank: Optional[Sequence[int]] = None,
                 per_node: bool = True) -> List[float]:
    """``data.weights`` as one weight per rank: given per rank (``world_size`` numbers) or per
    node (every rank of a node gets its node's number). ``node_of_rank`` is the node index of
    every rank; without it (planning for a world not running) nodes are assumed to hold equal
    blocks of consecutive ranks. ``per_node=False`` (a pipeline's replicas) allows only the
    first form. ConfigError when the count fits neither."""
    w = [float(x) for x in weights]
    if not w:
        return [1.0] * world_size
    if len(w) == world_size:
        return w
    if not per_node:
        raise ConfigError(f"data.weights: {len(w)} numbers for {world_size} data-parallel replicas; expected "
                          f"{world_size} (one per replica: a pipeline shares the data among its replicas)")
    if node_of_rank is None and world_size % len(w) == 0:
        node_of_rank = [r // (world_size // len(w)) for r in range(world_size)]
    if node_of_rank is not None:
        index = {n: i for i, n in enumerate(sorted(set(node_of_rank)))}
        if len(index) == len(w):
            return [w[index[n]] for n in node_of_rank]
        per = f"{len(index)} (one per node)"
    else:
        per = f"a divisor of {world_size} (one per node)"
    raise ConfigError(f"data.weights: {len(w)} numbers for {world_size} ranks; expected {world_size} (one per "
                      f"rank) or {per}\nHINT: give one weight per rank or per node")


def lr_factor(step: int, total_steps: int, sched: ScheduleConfig) -> float:
    """Multiplier of the (scaled) learning rate at optimizer step ``step`` (0-based)."""
    w = sched.warmup_steps
    if w > 0 and step < w:
        return (step + 1) / w
    if sched.kind == "constant":
        return 1.0
    if sched.kind == "step":
        return sched.gamma ** ((step - w) // sched.step_size)
    # cosine from 1 at the end of warm-up to min_factor at the last step
    span = max(1, total_steps - w - 1)
    t = min(1.0, max(0.0, (step - w) / span))
    return sched.min_factor + (1.0 - sched.min_factor) * 0.5 * (1.0 + math.cos(math.pi * t))


def eval_batch_size(requested: int, num_samples: int, world_size: int) -> int:
    """An evaluation batch that every rank can fill at least once (the planner's requirement)."""
    return max(1, min(requested, num_samples // max(1, world_size)))


def schedule_points(total_steps: int, interval: int, steps_per_epoch: int) -> List[int]:
    """Steps (1-based counts of completed steps) after which an interval action runs:
    every ``interval`` steps, or every epoch end when ``interval`` is 0; always the last."""
    every = interval or steps_per_epoch
    pts = list(range(every, total_steps + 1, every))
    if not pts or pts[-1] != total_steps:
        pts.append(total_steps)
    return pts
