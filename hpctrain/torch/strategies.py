"""How the ranks keep their models in agreement: the ``sync=`` option of DistributedOptimizer.

- ``allreduce`` (default): gradients are all-reduced (fused buckets, overlapped with backward);
  every rank steps its own optimizer on the same averaged gradient.
- ``parameter_server``: one server rank holds the master weights and the optimizer state;
  every rank's gradient is reduced to it, it steps, and the new weights are broadcast back.
  The math is the same as ``allreduce``; the cost moves to one rank (and other ranks keep no
  optimizer state).
- ``model_average``: local SGD. Each rank steps on its own gradient; every ``every`` steps the
  weights are replaced by their average weighted by the samples each rank processed since the
  last merge: ``w = sum_r n_r * w_r / sum_r n_r``.

This module holds the strategy descriptions (typed, validated) and the pure math; the
communication lives in ``optimizer.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

__all__ = ["AllReduce", "ParameterServer", "ModelAverage", "Strategy", "parse_sync", "weighted_average",
           "STRATEGIES"]

STRATEGIES = ("allreduce", "parameter_server", "model_average")


@dataclass(frozen=True)
class AllReduce:
    """All-reduce the gradients every step (the default)."""

    name: str = "allreduce"


@dataclass(frozen=True)
class ParameterServer:
    """Reduce gradients to ``server_rank``, step there, broadcast the weights back."""

    server_rank: int = 0
    name: str = "parameter_server"

    def __post_init__(self) -> None:
        if int(self.server_rank) < 0:
            raise ValueError(f"parameter_server server_rank={self.server_rank}: expected a rank >= 0")


@dataclass(frozen=True)
class ModelAverage:
    """Local SGD: step alone, merge weights every ``every`` steps, weighted by samples seen."""

    every: int = 1
    name: str = "model_average"

    def __post_init__(self) -> None:
        if int(self.every) < 1:
            raise ValueError(f"model_average every={self.every}: expected a number of steps >= 1")


Strategy = Union[AllReduce, ParameterServer, ModelAverage]


def parse_sync(sync: Union[str, Strategy, None]) -> Strategy:
    """``"allreduce"``, ``"parameter_server"``, ``"parameter_server:2"`` (server rank),
    ``"model_average"``, ``"model_average:8"`` (merge every 8 steps), or a strategy object."""
    if sync is None:
        return AllReduce()
    if isinstance(sync, (AllReduce, ParameterServer, ModelAverage)):
        return sync
    if not isinstance(sync, str):
        raise TypeError(f"sync={sync!r}: expected a string or a strategy object")
    name, _, arg = sync.strip().partition(":")
    name = name.strip().lower().replace("-", "_")
    if name not in STRATEGIES:
        raise ValueError(f"sync={sync!r}: unknown strategy; expected one of {', '.join(STRATEGIES)} "
                         "(parameter_server and model_average take an optional ':N')")
    if name == "allreduce":
        if arg:
            raise ValueError(f"sync={sync!r}: allreduce takes no argument")
        return AllReduce()
    try:
        value = int(arg) if arg else None
    except ValueError:
        raise ValueError(f"sync={sync!r}: the part after ':' must be an integer") from None
    if name == "parameter_server":
        return ParameterServer(server_rank=0 if value is None else value)
    return ModelAverage(every=1 if value is None else value)


def weighted_average(values: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_r w_r * v_r / sum_r w_r`` (equal weights when all weights are zero)."""
    if len(values) != len(weights) or not values:
        raise ValueError(f"weighted_average: {len(values)} values and {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0:
        weights, total = [1.0] * len(values), float(len(values))
    acc = torch.zeros_like(values[0], dtype=torch.float64)
    for v, w in zip(values, weights):
        acc += v.double() * float(w)
    return (acc / total).to(values[0].dtype)
