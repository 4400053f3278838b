"""A user's own model file and loss for examples/wine.yaml (paths in a config are relative to
the config's folder, so the config names this file as ``wine_model.py:net``)."""
import torch
from torch import nn


def net(in_features: int = 13, num_classes: int = 3, hidden: int = 32, dropout: float = 0.1) -> nn.Module:
    """A small MLP with BatchNorm (its running statistics are synchronised across ranks)."""
    return nn.Sequential(
        nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(hidden, num_classes),
    )


def smoothed_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The user's own loss: per-sample cross-entropy with a little label smoothing."""
    return nn.functional.cross_entropy(output.float(), target.long(), label_smoothing=0.05, reduction="none")
