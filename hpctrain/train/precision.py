"""Mixed precision for the runner: ``precision: fp32 | bf16 | fp16``.

bf16 and fp16 run the forward pass (and so the backward) under ``torch.autocast``; the
parameters, their gradients and therefore the gradient all-reduce stay fp32 unless
``sync.compression`` says otherwise. fp16 also scales the loss so that small gradients do not
flush to zero, with a scaler whose overflow check agrees across ranks: every rank skips the
same steps and backs off the same scale, so the replicas never drift apart (with the
all-reduce the gradients are equal anyway, but with model averaging or a parameter server
each rank's own gradient decides, and a rank that skipped alone would desynchronise the rest).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, Iterable, Mapping, Optional

import torch

__all__ = ["PRECISIONS", "PrecisionError", "AgreedScaler", "autocast", "check_precision"]

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(ValueError):
    """A precision this device cannot run."""


def check_precision(precision: str, device: torch.device) -> None:
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision: {precision!r} is not one of {', '.join(map(repr, PRECISIONS))}")
    if precision == "fp16" and device.type == "cpu":
        raise PrecisionError("precision: fp16 needs a GPU (CPU autocast computes in bf16)\n"
                             "HINT: use precision: bf16 on CPU")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise PrecisionError("precision: bf16 is not supported by this GPU\nHINT: use precision: fp16")


def autocast(precision: str, device: torch.device) -> ContextManager:
    """The context the forward pass (and loss) runs in."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


class AgreedScaler:
    """Dynamic loss scaling (as ``torch.amp.GradScaler``: x2 every ``growth_interval`` clean
    steps, x0.5 and skip on an overflow), with the overflow decision agreed by ``any_rank``
    (a callable: ``any_rank(local_flag) -> bool``, a MAX all-reduce in the runner)."""

    def __init__(self, any_rank: Callable[[bool], bool], init_scale: float = 2.0 ** 16,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        self.any_rank = any_rank
        self.scale = float(init_scale)
        self.growth_interval = int(growth_interval)
        self.enabled = enabled
        self.clean_steps = 0
        self.skipped = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide the gradients by the scale; True when every rank's are finite (step them)."""
        if not self.enabled:
            return True
        grads = [p.grad for p in params if p.grad is not None]
        inv = 1.0 / self.scale
        local_bad = False
        for g in grads:
            g.mul_(inv)
            local_bad = local_bad or not bool(torch.isfinite(g).all())
        ok = not self.any_rank(local_bad)
        self._update(ok)
        return ok

    def _update(self, ok: bool) -> None:
        if ok:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= 2.0
                self.clean_steps = 0
        else:
            self.scale = max(self.scale * 0.5, 1.0)
            self.clean_steps = 0
            self.skipped += 1

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: Optional[Mapping[str, float]]) -> None:
        if state:
            self.scale = float(state["scale"])
            self.clean_steps = int(state["clean_steps"])
            self.skipped = int(state.get("skipped", 0))
