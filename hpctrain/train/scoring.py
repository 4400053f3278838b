"""Evaluation metrics computed exactly across ranks: sum the counts, never average the scores.

Each rank folds its test batches into one float64 vector of sufficient statistics (sample
count, loss sum, a confusion matrix, per-output sums for regression, user sums); the runner
sums that vector over the ranks with one all-reduce and :func:`compute` turns the totals into
scores. Averaging per-rank F1 or R² would be wrong whenever ranks hold different samples.

``eval.metrics`` accepts::

    loss, accuracy, top3_accuracy (any k), precision, recall, f1   (macro, as scikit-learn's
    average='macro' over the classes present in targets or predictions), precision_per_class,
    recall_per_class, f1_per_class, confusion_matrix, mse, mae, r2 (scikit-learn's
    uniform average over outputs), and user functions 'file.py:fn' / 'pkg.mod:fn'.

A user metric takes ``(output, target)`` of a batch and returns one value per sample, or one
number taken as the batch mean; it is reported as the mean over every rank's real samples.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch

__all__ = ["CLASSIFICATION", "REGRESSION", "MetricSpec", "MetricError", "parse_metrics", "Accumulator",
           "compute", "state_size"]

CLASSIFICATION = ("accuracy", "precision", "recall", "f1", "precision_per_class", "recall_per_class",
                  "f1_per_class", "confusion_matrix")
REGRESSION = ("mse", "mae", "r2")
_TOPK = re.compile(r"top(\d+)_accuracy$")


class MetricError(ValueError):
    """A bad ``eval.metrics`` entry, or a metric that does not fit the model's output."""


@dataclass(frozen=True)
class MetricSpec:
    name: str                  # as written in the config (also the record key after "test_")
    kind: str                  # loss | classification | topk | regression | user
    k: int = 0
    function: str = ""

    @property
    def key(self) -> str:
        return "test_" + (self.function.rpartition(":")[2] if self.kind == "user" else self.name)


def parse_metrics(values: Sequence[Any], classification: Optional[bool]) -> List[MetricSpec]:
    """Check ``eval.metrics`` against the loss kind (no imports; ``None``: a user loss, whose
    kind the runner learns from the data's labels)."""
    specs = [_parse_one(v) for v in values]
    for s in specs if classification is not None else ():
        if s.kind in ("classification", "topk") and not classification:
            raise MetricError(f"eval.metrics: {s.name!r} needs a classification loss (cross_entropy)\n"
                              "HINT: use mse, mae or r2 for regression")
        if s.kind == "regression" and classification:
            raise MetricError(f"eval.metrics: {s.name!r} is a regression metric but the loss is a "
                              "classification loss\nHINT: use accuracy, precision, recall or f1")
    names = [s.key for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise MetricError(f"eval.metrics: {', '.join(dup)} listed twice")
    return specs


def _parse_one(value: Any) -> MetricSpec:
    if not isinstance(value, str):
        raise MetricError(f"eval.metrics: {value!r}; expected a metric name or 'file.py:function'")
    if ":" in value:
        mod, _, fn = value.rpartition(":")
        if not (mod and fn.isidentifier()):
            raise MetricError(f"eval.metrics: {value!r} is not 'file.py:function' or 'package.module:function'")
        return MetricSpec(value, "user", function=value)
    if value == "loss":
        return MetricSpec(value, "loss")
    m = _TOPK.match(value)
    if m and int(m.group(1)) >= 1:
        return MetricSpec(value, "topk", k=int(m.group(1)))
    if value in CLASSIFICATION:
        return MetricSpec(value, "classification")
    if value in REGRESSION:
        return MetricSpec(value, "regression")
    known = ", ".join(("loss",) + CLASSIFICATION + ("top5_accuracy",) + REGRESSION)
    raise MetricError(f"eval.metrics: {value!r} is not one of {known}\n"
                      "HINT: or give your own function as 'metrics.py:my_metric' taking (output, target)")


# -- the statistics vector --------------------------------------------------------------
# [count, loss_sum, user sums..., top-k hits..., confusion (C*C) | regression (4*C)]
def state_size(specs: Sequence[MetricSpec], classification: bool, width: int) -> int:
    users = sum(s.kind == "user" for s in specs)
    topk = sum(s.kind == "topk" for s in specs)
    return 2 + users + topk + (width * width if classification else 4 * width)


class Accumulator:
    """One rank's running sums over its test batches."""

    def __init__(self, specs: Sequence[MetricSpec], loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 classification: bool, user_fns: Optional[Mapping[str, Callable[..., Any]]] = None) -> None:
        self.specs = list(specs)
        self.loss = loss
        self.classification = classification
        self.user = [(s, (user_fns or {})[s.function]) for s in self.specs if s.kind == "user"]
        self.topk = [s.k for s in self.specs if s.kind == "topk"]
        self.count = 0.0
        self.loss_sum = 0.0
        self.user_sums = np.zeros(len(self.user))
        self.topk_hits = np.zeros(len(self.topk))
        self.width = 0
        self.table: Optional[np.ndarray] = None     # confusion (C, C) or regression (4, C)

    def update(self, out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> None:
        """Fold one batch in; ``mask`` marks the real (non-padding) samples."""
        keep = mask.bool()
        out, y = out[keep].detach(), y[keep].detach()
        n = int(out.shape[0])
        if n == 0:
            return
        flat = out.reshape(n, -1).double()
        self._grow(flat.shape[1])
        if self.classification:
            self._check_labels(y)
        self.count += n
        self.loss_sum += float(self.loss(out, y).double().sum())
        for i, (spec, fn) in enumerate(self.user):
            self.user_sums[i] += _user_sum(spec, fn, out, y)
        if self.classification:
            self._classify(flat, y.long().reshape(n))
        else:
            self._regress(flat, y.reshape(n, -1).double())

    def _grow(self, width: int) -> None:
        if self.table is None:
            self.width = width
            self.table = np.zeros((width, width) if self.classification else (4, width))
        elif width != self.width:
            raise MetricError(f"the model's output width changed from {self.width} to {width} between batches")

    def _check_labels(self, y: torch.Tensor) -> None:
        if y.is_floating_point() and not bool((y == y.round()).all()):
            raise MetricError("test labels are not whole numbers; a classification loss needs class indices\n"
                              "HINT: store integer labels, or use a regression loss (mse, huber)")
        if int(y.min()) < 0 or int(y.max()) >= self.width:
            raise MetricError(f"test labels {int(y.min())}..{int(y.max())} outside the model's "
                              f"{self.width} classes 0..{self.width - 1}\nHINT: num_classes must exceed the "
                              "largest label")

    def _classify(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        pred = logits.argmax(1)
        idx = (y * self.width + pred).cpu().numpy()
        self.table += np.bincount(idx, minlength=self.width * self.width).reshape(self.width, self.width)
        for i, k in enumerate(self.topk):
            top = logits.topk(min(k, self.width), dim=1).indices
            self.topk_hits[i] += float((top == y[:, None]).any(1).sum())

    def _regress(self, out: torch.Tensor, y: torch.Tensor) -> None:
        if y.shape != out.shape:
            raise MetricError(f"targets have {y.shape[1]} values per sample, the model outputs {out.shape[1]}")
        err = out - y
        rows = torch.stack([y.sum(0), (y * y).sum(0), (err * err).sum(0), err.abs().sum(0)])
        self.table += rows.cpu().numpy()

    def state(self, width: int) -> np.ndarray:
        """The statistics as one vector of the agreed ``width`` (the largest any rank saw: a rank
        without test batches contributes zeros of the same length)."""
        table = np.zeros((width, width) if self.classification else (4, width))
        if self.table is not None:
            if self.classification:
                table[:self.width, :self.width] = self.table
            else:
                table[:, :self.width] = self.table
        return np.concatenate([[self.count, self.loss_sum], self.user_sums, self.topk_hits, table.ravel()])


def _user_sum(spec: MetricSpec, fn: Callable[..., Any], out: torch.Tensor, y: torch.Tensor) -> float:
    value = fn(out, y)
    value = torch.as_tensor(value, dtype=torch.float64)
    if value.dim() == 0:
        return float(value) * out.shape[0]
    if value.shape != (out.shape[0],):
        raise MetricError(f"eval.metrics: {spec.function} returned shape {tuple(value.shape)}; expected a "
                          f"number or one value per sample ({out.shape[0]},)")
    return float(value.sum())


def compute(specs: Sequence[MetricSpec], total: np.ndarray, classification: bool, width: int) -> Dict[str, Any]:
    """Scores from the statistics summed over every rank: ``{"test_samples", "test_<name>"...}``."""
    n = float(total[0])
    res: Dict[str, Any] = {"test_samples": n}
    users = sum(s.kind == "user" for s in specs)
    topk = sum(s.kind == "topk" for s in specs)
    user_sums, topk_hits = total[2:2 + users], total[2 + users:2 + users + topk]
    table = total[2 + users + topk:]
    table = table.reshape((width, width) if classification else (4, width))
    per = _classification_scores(table) if classification else _regression_scores(table, n)
    iu = it = 0
    for s in specs:
        if s.kind == "loss":
            res[s.key] = total[1] / n if n else None
        elif s.kind == "user":
            res[s.key] = float(user_sums[iu] / n) if n else None
            iu += 1
        elif s.kind == "topk":
            res[s.key] = float(topk_hits[it] / n) if n else None
            it += 1
        else:
            res[s.key] = per[s.name] if n else None
    return {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in res.items()}


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a, dtype=np.float64), where=b > 0)


def _classification_scores(cm: np.ndarray) -> Dict[str, Any]:
    tp = np.diag(cm)
    true_n, pred_n = cm.sum(1), cm.sum(0)
    precision, recall = _safe_div(tp, pred_n), _safe_div(tp, true_n)
    f1 = _safe_div(2 * precision * recall, precision + recall)
    present = (true_n + pred_n) > 0
    macro = (lambda v: float(v[present].mean()) if present.any() else 0.0)
    return {
        "accuracy": float(tp.sum() / cm.sum()) if cm.sum() else 0.0,
        "precision": macro(precision), "recall": macro(recall), "f1": macro(f1),
        "precision_per_class": precision.tolist(), "recall_per_class": recall.tolist(),
        "f1_per_class": f1.tolist(), "confusion_matrix": cm.astype(np.int64).tolist(),
    }


def _regression_scores(t: np.ndarray, n: float) -> Dict[str, Any]:
    sum_y, sum_y2, sse, sae = t
    width = t.shape[1]
    if not n:
        return {"mse": 0.0, "mae": 0.0, "r2": 0.0}
    sst = sum_y2 - sum_y * sum_y / n
    # scikit-learn: a constant target column scores 1.0 when predicted exactly, else 0.0
    r2 = np.where(sst > 0, 1.0 - _safe_div(sse, sst), np.where(sse == 0, 1.0, 0.0))
    return {"mse": float(sse.sum() / (n * width)), "mae": float(sae.sum() / (n * width)), "r2": float(r2.mean())}
