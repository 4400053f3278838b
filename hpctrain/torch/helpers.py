"""Small things every data-parallel script needs: metric averaging, a distributed sampler for
in-memory datasets, learning-rate scaling, and rank-0 printing/logging."""
from __future__ import annotations

import functools
import logging
import math
import random
from typing import Any, Callable, Iterator, List, Optional, Sized, TypeVar, Union

import torch

from hpctrain import comm

__all__ = ["metric_average", "shard_indices", "DistributedSampler", "scale_lr", "warmup_factor",
           "print0", "log0", "rank_zero_only", "get_logger"]

F = TypeVar("F", bound=Callable[..., Any])


def metric_average(value: Union[float, int, torch.Tensor], name: Optional[str] = None) -> float:
    """Average a scalar metric (loss, accuracy) over all ranks; every rank gets the result."""
    if not comm.is_initialized() or comm.size() == 1:
        return float(value)
    t = torch.tensor([float(value.item() if isinstance(value, torch.Tensor) else value)], dtype=torch.float64)
    return float(comm.allreduce(t, op="avg")[0])


def shard_indices(length: int, num_replicas: int, rank: int, *, shuffle: bool = True, seed: int = 0,
                  epoch: int = 0, drop_last: bool = False) -> List[int]:
    """The indices rank ``rank`` of ``num_replicas`` reads in epoch ``epoch`` (pure).

    Same contract as ``torch.utils.data.DistributedSampler``: one permutation per (seed, epoch)
    shared by all ranks; rank r takes every ``num_replicas``-th index starting at r. Every rank
    gets the same count — ``ceil(length / num_replicas)`` (the list is padded by repeating its
    beginning) or, with ``drop_last``, ``floor(length / num_replicas)`` — because unequal step
    counts would hang collectives.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas}: expected >= 1")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank={rank} is outside 0..{num_replicas - 1}")
    if length < 0:
        raise ValueError(f"length={length}: expected >= 0")
    order = list(range(length))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    if drop_last:
        per_rank = length // num_replicas
        order = order[:per_rank * num_replicas]
    else:
        per_rank = math.ceil(length / num_replicas) if length else 0
        total = per_rank * num_replicas
        if total > len(order) and order:
            reps = math.ceil((total - len(order)) / len(order))
            order = order + (order * reps)[:total - len(order)]
    return order[rank:per_rank * num_replicas:num_replicas]


class DistributedSampler(torch.utils.data.Sampler):
    """Each rank's share of an in-memory dataset (or any ``len()``-able), reshuffled per epoch.

    ``DistributedSampler(dataset)`` takes ``num_replicas``/``rank`` from ``hvd.size()``/``hvd.rank()``;
    call ``set_epoch(epoch)`` at the start of every epoch for a new shuffle.
    """

    def __init__(self, dataset: Union[Sized, int], num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        self.length = int(dataset) if isinstance(dataset, int) else len(dataset)
        self.num_replicas = comm.size() if num_replicas is None else int(num_replicas)
        self.rank = comm.rank() if rank is None else int(rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        shard_indices(0, self.num_replicas, self.rank)  # validate rank/num_replicas now

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of epoch ``epoch``."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(shard_indices(self.length, self.num_replicas, self.rank, shuffle=self.shuffle,
                                  seed=self.seed, epoch=self.epoch, drop_last=self.drop_last))

    def __len__(self) -> int:
        if self.drop_last:
            return self.length // self.num_replicas
        return math.ceil(self.length / self.num_replicas) if self.length else 0


def scale_lr(base_lr: float, world_size: Optional[int] = None, rule: str = "linear") -> float:
    """Learning rate for ``world_size`` ranks when ``base_lr`` was tuned for one.

    ``rule="linear"`` (Goyal et al. 2017, for SGD): ``base_lr * world_size``; ``"sqrt"`` (often
    better for Adam): ``base_lr * sqrt(world_size)``; ``"none"``: unchanged.
    """
    n = comm.size() if world_size is None else int(world_size)
    if n < 1:
        raise ValueError(f"world_size={n}: expected >= 1")
    if rule == "linear":
        return base_lr * n
    if rule == "sqrt":
        return base_lr * math.sqrt(n)
    if rule == "none":
        return base_lr
    raise ValueError(f"rule={rule!r}: expected 'linear', 'sqrt' or 'none'")


def warmup_factor(step: int, warmup_steps: int, world_size: Optional[int] = None) -> float:
    """Multiplier for a scaled learning rate during warm-up: grows linearly from ``1/world_size``
    (the single-rank rate) to 1 over ``warmup_steps`` steps; use with ``LambdaLR``."""
    n = comm.size() if world_size is None else int(world_size)
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    start = 1.0 / n
    return start + (1.0 - start) * step / warmup_steps


def _is_rank_zero() -> bool:
    return not comm.is_initialized() or comm.rank() == 0


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only (flushes)."""
    if _is_rank_zero():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def get_logger(name: str = "hpctrain") -> logging.Logger:
    """The named logger (never configured here: the application configures logging)."""
    return logging.getLogger(name)


def log0(msg: str, *args: Any, level: int = logging.INFO, logger: Optional[logging.Logger] = None) -> None:
    """Log on rank 0 only."""
    if _is_rank_zero():
        (logger or get_logger()).log(level, msg, *args)


def rank_zero_only(fn: F) -> F:
    """Decorator: run ``fn`` on rank 0 only (other ranks get None)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_rank_zero():
            return fn(*args, **kwargs)
        return None
    return wrapper  # type: ignore[return-value]
