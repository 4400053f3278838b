"""What the model is trained to do: loss, metrics, precision and input normalisation.

:class:`Task` is built once per run from the config (user loss and metric functions imported
from their files) and handed to the step objects (:mod:`hpctrain.train.steps`), which call
:meth:`Task.forward` / :meth:`Task.loss` in their step and :meth:`Task.evaluate` for the
exact cross-rank metrics. Everything here is the same on every rank.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

from hpctrain import comm
from hpctrain.train import scoring
from hpctrain.train.config import ConfigError, TrainConfig
from hpctrain.train.losses import LossError, build_loss, parse_loss
from hpctrain.train.normalize import FeatureStats, Normalizer
from hpctrain.train.precision import AgreedScaler, PrecisionError, autocast, check_precision

__all__ = ["Task", "build_task", "label_kind"]

log = logging.getLogger("hpctrain.train")


@dataclass
class Task:
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    classification: bool
    metrics: List[scoring.MetricSpec]
    metric_fns: Dict[str, Callable[..., Any]]
    precision: str
    device: torch.device
    normalizer: Optional[Normalizer] = None
    scaler: Optional[AgreedScaler] = None
    best: Any = None                 # stopping.Improvement of checkpoint.keep_best
    stopper: Any = None              # stopping.Improvement of early_stopping
    extra_state: Dict[str, Any] = field(default_factory=dict)

    # -- checkpoints ---------------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the task (plain data and tensors: weights_only loads)."""
        out: Dict[str, Any] = {}
        if self.normalizer is not None:
            out["normalize"] = self.normalizer.state()
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.state_dict()
        if self.best is not None:
            out["best"] = self.best.state_dict()
        if self.stopper is not None:
            out["early_stopping"] = self.stopper.state_dict()
        return out

    def load_state(self, extra: Dict[str, Any]) -> None:
        if extra.get("normalize") is not None:
            self.normalizer = Normalizer.from_state(extra["normalize"])
        if self.scaler is not None:
            self.scaler.load_state_dict(extra.get("loss_scale"))
        if self.best is not None and extra.get("best"):
            self.best.load_state_dict(extra["best"])
        if self.stopper is not None and extra.get("early_stopping"):
            self.stopper.load_state_dict(extra["early_stopping"])

    # -- the step -----------------------------------------------------------------------
    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """The model's input: normalised when ``data.normalize`` is set."""
        return self.normalizer(x) if self.normalizer is not None else x

    def forward(self, model: torch.nn.Module, x: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
        """The model on this batch's inputs (``data.keys.x`` in order; normalisation applies
        to a single input)."""
        with autocast(self.precision, self.device):
            return model(self.prepare(x), *more)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-sample loss in fp32 (outside autocast, as torch.amp recommends for losses)."""
        # labels were checked against the model once before the first step (train.checks)
        return self.loss_fn(out.float(), y)

    def correct(self, out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> float:
        if not self.classification:
            return 0.0
        return float(((out.detach().argmax(1) == y) & mask.bool()).sum())

    # -- evaluation ---------------------------------------------------------------------
    def accumulator(self) -> scoring.Accumulator:
        return scoring.Accumulator(self.metrics, lambda o, t: self.loss_fn(o.float(), t), self.classification,
                                   self.metric_fns)

    def reduce(self, acc: scoring.Accumulator, group: Any = None) -> Dict[str, Any]:
        """Collective: every rank's statistics summed; the scores (same on every rank)."""
        width = int(comm.allreduce(np.array([acc.width], dtype=np.float64), op="max")[0])
        total = comm.allreduce(acc.state(width), op="sum")
        res = scoring.compute(self.metrics, total, self.classification, width)
        res.setdefault("test_loss", None)
        res.setdefault("test_accuracy", None)
        return res


def label_kind(cfg: TrainConfig) -> bool:
    """Whether the training labels are integers (a classification task), from HDF5 metadata."""
    from hpctrain.data.h5files import describe, expand_paths

    yk = cfg.data.keys["y"]
    info = describe(expand_paths(list(cfg.data.train))[0], [yk])
    wanted = cfg.data.dtypes.get("y")
    kind = np.dtype(wanted).kind if wanted else np.dtype(info.keys[yk].dtype).kind
    return kind in "iub"


def build_task(cfg: TrainConfig, device: torch.device, importer: Callable[..., Any]) -> Task:
    """The run's task; user functions are imported here (errors name the config key)."""
    from hpctrain.train.stopping import Improvement

    try:
        spec = parse_loss(cfg.loss)
        loss_fn = build_loss(spec, importer=lambda s: importer(s, "loss"))
        classification = spec.classification if spec.classification is not None else label_kind(cfg)
        metrics = scoring.parse_metrics(cfg.eval.metrics, classification)
        check_precision(cfg.precision, device)
    except (LossError, scoring.MetricError, PrecisionError) as exc:
        raise ConfigError(str(exc)) from None
    fns = {m.function: importer(m.function, "eval.metrics") for m in metrics if m.kind == "user"}
    task = Task(loss_fn=loss_fn, classification=classification, metrics=metrics, metric_fns=fns,
                precision=cfg.precision, device=device)
    if cfg.precision == "fp16":
        task.scaler = AgreedScaler(lambda bad: bool(comm.allreduce(np.array([float(bad)]), op="max")[0]))
    if cfg.checkpoint.keep_best:
        task.best = Improvement(cfg.checkpoint.keep_best)
    if cfg.early_stopping:
        task.stopper = Improvement(**cfg.early_stopping)
    return task


def compute_normalizer(cfg: TrainConfig, batches: Iterable[Dict[str, torch.Tensor]], key: str) -> Normalizer:
    """Collective: statistics of every rank's training inputs (``batches``: this rank's
    share, padding masked out), summed over the ranks."""
    stats: Optional[FeatureStats] = None
    for batch in batches:
        x = batch[key][batch["mask"].bool()].numpy()
        if stats is None:
            stats = FeatureStats(int(np.prod(batch[key].shape[1:])))
        stats.update(x)
    width = int(comm.allreduce(np.array([stats.width if stats else 0], dtype=np.float64), op="max")[0])
    if stats is None:
        stats = FeatureStats(width)
    sums = comm.allreduce(stats.sums, op="sum")
    low = comm.allreduce(stats.low, op="min")
    high = comm.allreduce(stats.high, op="max")
    norm = Normalizer.from_totals(cfg.data.normalize, sums, low, high)
    if comm.rank() == 0:
        log.info("data.normalize: %s statistics over %d training samples", cfg.data.normalize, int(sums[0]))
    return norm


def scores_summary(results: Dict[str, Any], names: Sequence[str]) -> str:
    """``"f1 0.9412, accuracy 0.9556"`` of the scalar metrics (for the log line)."""
    out = []
    for n in names:
        v = results.get("test_" + n)
        if isinstance(v, float):
            out.append(f"test {n} {v:.4f}")
    return ", ".join(out)
