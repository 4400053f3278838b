"""Gradient clipping applied to the global gradient, after the all-reduce.

Horovod users write ``optimizer.synchronize(); clip_grad_norm_(...); with
optimizer.skip_synchronize(): optimizer.step()`` so that the norm is that of the averaged
gradient, identical on every rank; the runner does the same for ``clip_grad_norm`` /
``clip_grad_value``. With pipeline stages each rank holds a different part of the model, so
the squared norms are summed over the stages first (the global norm of the whole model).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import numpy as np
import torch

__all__ = ["clip_gradients"]


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float = 0.0, max_value: float = 0.0,
                   squared_norm_sum: Optional[Callable[[float], float]] = None) -> float:
    """Clip the (already all-reduced) gradients; return the global norm before clipping.

    ``squared_norm_sum(local)`` sums squared norms over the ranks that hold different
    parameters (pipeline stages); data-parallel replicas hold the same gradients after the
    all-reduce, so their norm is already global (None)."""
    grads = [p.grad for p in params if p.grad is not None]
    if max_value > 0:
        for g in grads:
            g.clamp_(-max_value, max_value)
    local = float(sum(float(g.detach().double().pow(2).sum()) for g in grads))
    total = float(np.sqrt(squared_norm_sum(local) if squared_norm_sum else local))
    if max_norm > 0 and total > max_norm:
        factor = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(factor)
    return total
