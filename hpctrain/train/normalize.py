"""Input normalisation with statistics computed exactly over every rank's training data.

``data.normalize: standard | minmax | none``. Each rank reduces its own share of the
training inputs to per-feature sums (count, sum, sum of squares: float64) and extremes; the
runner sums / min / max them over the ranks once, before training, and the resulting
:class:`Normalizer` (a module with buffers) is stored in checkpoints and applied in front of
the model at training, evaluation and after a resume, and by ``hpctrain.load_model``.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import numpy as np
import torch
from torch import nn

__all__ = ["MODES", "FeatureStats", "Normalizer", "Normalized", "NormalizeError"]

MODES = ("none", "standard", "minmax")


class NormalizeError(ValueError):
    """Statistics that cannot normalise (no samples, mismatched widths)."""


class FeatureStats:
    """Running per-feature statistics of one rank's inputs (rows = samples)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.sums = np.zeros(2 * width + 1)            # [count, sum(F), sum of squares(F)]
        self.low = np.full(width, np.inf)
        self.high = np.full(width, -np.inf)

    def update(self, x: np.ndarray) -> None:
        rows = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
        if rows.shape[1] != self.width:
            raise NormalizeError(f"data.normalize: a batch has {rows.shape[1]} features, expected {self.width}")
        if not len(rows):
            return
        self.sums[0] += len(rows)
        self.sums[1:1 + self.width] += rows.sum(0)
        self.sums[1 + self.width:] += (rows * rows).sum(0)
        self.low = np.minimum(self.low, rows.min(0))
        self.high = np.maximum(self.high, rows.max(0))


class Normalizer(nn.Module):
    """``(x - shift) / scale`` per feature, on inputs flattened to ``[batch, features]`` and
    reshaped back. Built from statistics summed over the ranks."""

    def __init__(self, mode: str, shift: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if mode not in MODES[1:]:
            raise NormalizeError(f"data.normalize: {mode!r} is not one of {', '.join(map(repr, MODES))}")
        self.mode = mode
        self.register_buffer("shift", shift.to(torch.float32))
        self.register_buffer("scale", scale.to(torch.float32))

    @classmethod
    def from_totals(cls, mode: str, sums: np.ndarray, low: np.ndarray, high: np.ndarray) -> "Normalizer":
        """From the statistics summed (``sums``), min-reduced (``low``) and max-reduced (``high``)
        over every rank. Constant features get scale 1 (they map to 0), never a division by 0."""
        width = len(low)
        n = float(sums[0])
        if n <= 0:
            raise NormalizeError("data.normalize: no training samples to compute statistics from")
        if mode == "standard":
            mean = sums[1:1 + width] / n
            var = np.maximum(sums[1 + width:] / n - mean * mean, 0.0)
            shift, scale = mean, np.sqrt(var)
        else:
            shift, scale = low, high - low
        scale = np.where(scale > 1e-12, scale, 1.0)
        return cls(mode, torch.from_numpy(shift), torch.from_numpy(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1)
        if flat.shape[1] != self.shift.numel():
            raise NormalizeError(f"input has {flat.shape[1]} features but the normalisation statistics have "
                                 f"{self.shift.numel()}")
        shift = self.shift.to(device=flat.device, dtype=flat.dtype)
        scale = self.scale.to(device=flat.device, dtype=flat.dtype)
        return ((flat - shift) / scale).reshape(x.shape)

    def state(self) -> Dict[str, object]:
        """Plain data for a checkpoint (tensors and a string: loads with weights_only=True), in
        the form ``hpctrain export`` / ``load_model`` read: ``{kind, mean, std}`` or ``{kind, min, max}``."""
        if self.mode == "standard":
            return {"kind": "standard", "mean": self.shift.clone(), "std": self.scale.clone()}
        return {"kind": "minmax", "min": self.shift.clone(), "max": (self.shift + self.scale).clone()}

    @classmethod
    def from_state(cls, state: Optional[Mapping[str, object]]) -> Optional["Normalizer"]:
        if not state or state.get("kind") == "none":
            return None
        if "mean" in state:
            return cls("standard", torch.as_tensor(state["mean"]), torch.as_tensor(state["std"]))
        low = torch.as_tensor(state["min"])
        return cls("minmax", low, torch.as_tensor(state["max"]) - low)


class Normalized(nn.Module):
    """A model with its input normalisation in front (what ``load_model`` returns)."""

    def __init__(self, normalizer: Normalizer, model: nn.Module) -> None:
        super().__init__()
        self.normalizer = normalizer
        self.model = model

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return self.model(self.normalizer(x), *rest)

