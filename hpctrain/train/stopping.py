"""Early stopping and the best checkpoint: which evaluation improved, and when to stop.

The value each rank sees is computed from all-reduced sums (``scoring.compute``), so every
rank takes the same decision without another collective. The state is plain numbers, stored
in checkpoints so that a resumed run keeps its patience count and its best value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

__all__ = ["Improvement", "StoppingError", "Verdict", "mode_for", "LOWER_IS_BETTER"]

#: metrics where lower is better; every other metric is maximised unless ``mode`` says otherwise
LOWER_IS_BETTER = ("loss", "mse", "mae")


class StoppingError(ValueError):
    """A bad ``early_stopping`` / ``checkpoint.keep_best`` value."""


def mode_for(metric: str, mode: str = "auto") -> str:
    if mode == "auto":
        return "min" if metric in LOWER_IS_BETTER else "max"
    if mode not in ("min", "max"):
        raise StoppingError(f"early_stopping.mode: {mode!r} is not one of 'min', 'max', 'auto'")
    return mode


@dataclass(frozen=True)
class Verdict:
    improved: bool
    stop: bool
    best: float


class Improvement:
    """Tracks the best value of one metric; ``patience`` evaluations without an improvement of
    more than ``min_delta`` stop the run (``patience=0``: never stop, only track the best)."""

    def __init__(self, metric: str, mode: str = "auto", patience: int = 0, min_delta: float = 0.0) -> None:
        if patience < 0:
            raise StoppingError(f"early_stopping.patience: {patience} < 0; expected evaluations to wait (>= 1)")
        if min_delta < 0:
            raise StoppingError(f"early_stopping.min_delta: {min_delta} < 0; expected an absolute margin >= 0")
        self.metric = metric
        self.mode = mode_for(metric, mode)
        self.patience = patience
        self.min_delta = float(min_delta)
        self.best: Optional[float] = None
        self.waited = 0

    def update(self, results: Mapping[str, Any]) -> Verdict:
        """Fold one evaluation's results (``{"test_<metric>": value}``) in."""
        key = "test_" + self.metric
        if key not in results or results[key] is None:
            raise StoppingError(f"early stopping watches {self.metric!r} but the evaluation computed "
                                f"{sorted(k[5:] for k in results if k.startswith('test_'))}\n"
                                f"HINT: add {self.metric} to eval.metrics")
        value = float(results[key])
        if self._better(value):
            self.best, self.waited = value, 0
            return Verdict(True, False, value)
        self.waited += 1
        return Verdict(False, self.patience > 0 and self.waited >= self.patience, self.best)

    def _better(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def state_dict(self) -> Dict[str, Any]:
        return {"metric": self.metric, "mode": self.mode, "best": self.best, "waited": self.waited}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("metric") == self.metric and state.get("mode") == self.mode:
            self.best, self.waited = state.get("best"), int(state.get("waited", 0))
