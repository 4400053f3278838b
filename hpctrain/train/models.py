"""Small models for the examples and tests: an MLP and a CNN for 8x8 digit images.

Factories are referenced from a config as ``model: {factory: "hpctrain.train.models:mlp",
kwargs: {...}}``. Your own model: any importable ``module:function`` (or
``path/to/file.py:function``) returning a ``torch.nn.Module``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class Scale(nn.Module):
    """Multiply the input by a constant (e.g. 1/16 for digits pixels in 0..16)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = float(factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor}"


def mlp(in_features: int = 64, hidden: Sequence[int] = (128, 64), num_classes: int = 10,
        dropout: float = 0.0, input_scale: float = 1.0) -> nn.Module:
    """Flatten -> scale -> [Linear -> ReLU -> Dropout] per hidden width -> Linear."""
    layers: list = [nn.Flatten(), Scale(input_scale)]
    width = int(in_features)
    for h in hidden:
        layers += [nn.Linear(width, int(h)), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(float(dropout)))
        width = int(h)
    layers.append(nn.Linear(width, int(num_classes)))
    return nn.Sequential(*layers)


def cnn(channels: Sequence[int] = (16, 32), num_classes: int = 10, side: int = 8, dropout: float = 0.0,
        input_scale: float = 1.0 / 16) -> nn.Module:
    """A small CNN for ``side`` x ``side`` one-channel images given as flat rows (digits: 64)."""
    c1, c2 = (int(c) for c in channels)
    return nn.Sequential(
        Scale(input_scale),
        nn.Unflatten(1, (1, side, side)),
        nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(float(dropout)) if dropout > 0 else nn.Identity(),
        nn.Linear(c2 * (side // 2) ** 2, int(num_classes)),
    )
