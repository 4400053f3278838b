"""An activation-heavy, compute-light tuning target: few weights, ~1.5 MiB of activations
per sample, so the largest batch under a small memory cap is small and each trial takes
milliseconds. The probe's tests use it; try:

    hpctrain probe --tune-batch examples/tune_wide.py:factory --max-memory 192MiB
"""
from __future__ import annotations

import torch
from torch import nn

from hpctrain.probe import TuneTarget

WIDTH = 65536  # floats per sample


class Wide(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.shift = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x * self.scale + self.shift)
        h = torch.sigmoid(h * self.scale)
        return h.mean(dim=1)


def make_batch(batch_size: int):
    return torch.ones(batch_size, WIDTH), torch.zeros(batch_size)


def factory() -> TuneTarget:
    return TuneTarget(
        model_factory=Wide,
        make_batch=make_batch,
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-3),
        loss_fn=nn.functional.mse_loss,
        base_lr=1e-3,
        base_batch=32,
        lr_rule="sqrt",
    )
