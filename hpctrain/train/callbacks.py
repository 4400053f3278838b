"""What happens after a step, an evaluation, an epoch: small hooks with one interface.

The runner's own actions (progress bar, straggler warnings and re-balancing, evaluation,
checkpoints) are :class:`Callback` subclasses; user callbacks (``callbacks: [my.py:MyCallback]``
in the config, instantiated without arguments) get the same hook points, after the built-in
ones. Every hook runs on **every rank**, at the same point of the same step, so a callback may
use collectives (``hpctrain.comm``) as long as it calls the same ones on every rank; write
files or print on rank 0 only (``loop.run.rank == 0``).

What a hook sees: ``loop.run`` (:class:`hpctrain.train.build.Run`: ``cfg``, ``model``,
``opt``, ``plan``, ``rank``, ``world``, ``metrics``) and ``loop.state``
(:class:`hpctrain.train.loop.LoopState`: ``step`` completed steps, ``epoch``, ``last_loss``,
``last_eval``, ``last_ckpt``, ``stopping``).
"""
from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import numpy as np

from hpctrain.train.config import ConfigError
from hpctrain.train.metrics import StragglerDetector, rebalance_weights
from hpctrain.train.plan import make_plan, schedule_points

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.train.build import Run
    from hpctrain.train.loop import TrainLoop

log = logging.getLogger("hpctrain.train")

#: The hook points, in the order a run reaches them.
HOOKS = ("on_fit_start", "on_step_end", "on_eval_end", "on_checkpoint", "on_epoch_end", "on_fit_end", "close")


class Callback:
    """Base class of the runner's hooks; override the ones you need (each is a no-op here).

    - ``on_fit_start(loop)``: before the first step (after a resume: before the first new one).
    - ``on_step_end(loop)``: after each optimizer step; ``loop.state.step`` counts completed steps.
    - ``on_eval_end(loop, results)``: after an evaluation (``{"test_loss", "test_accuracy", …}``).
    - ``on_checkpoint(loop, path)``: after a checkpoint was written.
    - ``on_epoch_end(loop)``: after the last step of an epoch.
    - ``on_fit_end(loop, result)``: after training, with the :class:`FitResult`.
    - ``close(loop)``: always, also after an error: release what the callback holds.
    """

    def on_fit_start(self, loop: "TrainLoop") -> None:
        """Before the first step."""

    def on_step_end(self, loop: "TrainLoop") -> None:
        """After each optimizer step."""

    def on_eval_end(self, loop: "TrainLoop", results: Dict[str, Optional[float]]) -> None:
        """After an evaluation."""

    def on_checkpoint(self, loop: "TrainLoop", path: str) -> None:
        """After a checkpoint was written."""

    def on_epoch_end(self, loop: "TrainLoop") -> None:
        """After the last step of an epoch."""

    def on_fit_end(self, loop: "TrainLoop", result: Any) -> None:
        """After training."""

    def close(self, loop: "TrainLoop") -> None:
        """Always called at the end, also after an error."""


def load_callbacks(specs: Sequence[str]) -> List[Callback]:
    """Instantiate ``"file.py:Class"`` / ``"pkg.mod:Class"`` (no arguments); ConfigError when a
    spec does not import or its object has none of the hook methods."""
    from hpctrain.train.build import import_factory

    out: List[Callback] = []
    for i, spec in enumerate(specs):
        where = f"callbacks[{i}]"
        cls = import_factory(spec, what=where)
        try:
            obj = cls()
        except TypeError as exc:
            raise ConfigError(f"{where}: {spec!r} cannot be instantiated without arguments ({exc})\n"
                              "HINT: give the callback's __init__ defaults for every argument") from exc
        if not any(callable(getattr(obj, h, None)) for h in HOOKS):
            raise ConfigError(f"{where}: {spec!r} has none of the hook methods {', '.join(HOOKS)}\n"
                              "HINT: subclass hpctrain.train.callbacks.Callback")
        out.append(obj)
    return out


class ProgressBar(Callback):
    """tqdm bar on rank 0 (unless ``quiet``) when stderr is a terminal; in a job's log file
    (not a terminal) one summary line every ``log_interval`` steps instead of a bar's
    carriage returns; evaluation results as one line."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.lines = False

    def on_fit_start(self, loop: "TrainLoop") -> None:
        run = loop.run
        if run.rank != 0 or run.cfg.quiet:
            return
        if not sys.stderr.isatty():
            self.lines = True
            return
        from tqdm import tqdm

        self.bar = tqdm(total=run.plan.total_steps, initial=loop.state.step, unit="step", dynamic_ncols=True,
                        mininterval=0.5, desc="train", file=sys.stderr)

    def on_step_end(self, loop: "TrainLoop") -> None:
        st, total = loop.state, loop.run.plan.total_steps
        if self.lines and (st.step % loop.run.cfg.log_interval == 0 or st.step == total):
            log.info("step %d/%d epoch %d: loss %.4f, %.0f samples/s", st.step, total, st.epoch, st.last_loss,
                     loop.last_rate())
        if self.bar is None:
            return
        self.bar.update(1)
        if st.step % loop.run.cfg.log_interval == 0 or st.step == total:
            self.bar.set_postfix(loss=f"{st.last_loss:.4f}", samples_s=f"{loop.last_rate():.0f}", epoch=st.epoch,
                                 refresh=False)

    def on_eval_end(self, loop: "TrainLoop", results: Dict[str, Optional[float]]) -> None:
        if loop.run.rank != 0:
            return
        st = loop.state
        acc = results.get("test_accuracy")
        others = [f"test {k[5:]} {v:.4f}" for k, v in results.items()
                  if isinstance(v, float) and k not in ("test_loss", "test_accuracy", "test_samples")]
        msg = (f"step {st.step}/{loop.run.plan.total_steps} epoch {st.epoch}: loss {st.last_loss:.4f}, "
               f"test loss {results.get('test_loss') or float('nan'):.4f}"
               + (f", test accuracy {acc:.4f}" if acc is not None else "")
               + "".join(", " + o for o in others))
        (self.bar.write(msg) if self.bar is not None else log.info(msg))

    def close(self, loop: "TrainLoop") -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Throughput(Callback):
    """Per interval of ``log_interval`` steps: straggler warnings from every rank's measured
    busy time; at an epoch end with ``balance: auto``: new data shares from samples/s."""

    def __init__(self, run: "Run") -> None:
        cfg, world = run.cfg, run.world
        self.detector = StragglerDetector(cfg.straggler_threshold, cfg.straggler_patience)
        self.rows: List[np.ndarray] = []
        self.epoch_busy = np.zeros(world)
        self.epoch_samples = np.zeros(world)

    def on_step_end(self, loop: "TrainLoop") -> None:
        run = loop.run
        self.rows.append(loop.rows[:, loop.TIMES:])
        if len(self.rows) < run.cfg.log_interval:
            return
        t = np.stack(self.rows)  # (steps, world, fields)
        busy_r = (t[:, :, 0] - t[:, :, 4]).mean(axis=0)
        self.epoch_busy += (t[:, :, 0] - t[:, :, 4]).sum(axis=0)
        self.epoch_samples += len(self.rows) * run.rank_batches() * run.plan.accumulation
        for rep in self.detector.update(busy_r.tolist()):
            if run.rank == 0:
                log.warning(
                    "straggler: rank %d is %.0f%% slower than the median (%.1f ms vs %.1f ms "
                    "busy per step) for %d intervals%s", rep["rank"], 100 * rep["slower_by"],
                    1e3 * rep["busy"], 1e3 * rep["median"], run.cfg.straggler_patience,
                    "" if run.cfg.balance == "auto" else
                    "; HINT: balance the stages with parallel.split_points (or balance: time)"
                    if run.pipe is not None else "; HINT: balance: auto re-weights the data")
            run.metrics.write({"kind": "event", "step": loop.state.step, "what": "straggler", **rep})
        self.rows = []

    def on_epoch_end(self, loop: "TrainLoop") -> None:
        run = loop.run
        if run.cfg.balance == "auto" and run.world > 1 and self.epoch_busy.sum() > 0:
            rates = (self.epoch_samples / np.maximum(self.epoch_busy, 1e-9)).tolist()
            new = rebalance_weights(rates, run.weights)
            if new is not None:
                self._rebalance(loop, new, rates)
        self.epoch_busy[:] = 0
        self.epoch_samples[:] = 0

    @staticmethod
    def _rebalance(loop: "TrainLoop", weights: List[float], rates: List[float]) -> None:
        run = loop.run
        run.weights = weights
        run.plan = make_plan(run.cfg, [run.plan.train_samples], [run.plan.test_samples], run.world,
                             run.plan.batch_size, weights)
        run.ds.close()
        run.ds = run.train_set(weights)
        if run.rank == 0:
            log.info("balance: new data shares per rank %s (batch sizes %s) from measured samples/s %s", weights,
                     list(run.plan.rank_batch_sizes), [round(r) for r in rates])
        run.metrics.write({"kind": "event", "step": loop.state.step, "what": "rebalance", "weights": weights,
                           "batch_sizes": list(run.plan.rank_batch_sizes)})


class Evaluation(Callback):
    """Exact evaluation on ``data.test`` every ``eval.interval_steps`` (or epoch) and at the end."""

    def __init__(self, run: "Run") -> None:
        plan, cfg = run.plan, run.cfg
        self.at = set(schedule_points(plan.total_steps, cfg.eval.interval_steps, plan.steps_per_epoch))

    def on_step_end(self, loop: "TrainLoop") -> None:
        run = loop.run
        if loop.state.step not in self.at or run.test_ds is None:
            return
        loop.sync_model()
        results = run.step_impl.evaluate(run.test_ds)
        loop.state.last_eval = results
        loop.emit("on_eval_end", results)

    def on_eval_end(self, loop: "TrainLoop", results: Dict[str, Optional[float]]) -> None:
        run, st = loop.run, loop.state
        run.metrics.write({"kind": "eval", "step": st.step, "epoch": st.epoch, **results})
        if run.tb is not None:
            for key, v in results.items():
                if isinstance(v, (int, float)):  # lists (per class, confusion matrix) are not scalars
                    run.tb.add_scalar("eval/" + key, v, st.step)


class Checkpointing(Callback):
    """A checkpoint every ``checkpoint.interval_steps`` (or epoch), at the end, and at a stop."""

    def __init__(self, run: "Run") -> None:
        plan, cfg = run.plan, run.cfg
        self.at = set(schedule_points(plan.total_steps, cfg.checkpoint.interval_steps, plan.steps_per_epoch))

    def on_step_end(self, loop: "TrainLoop") -> None:
        run, st = loop.run, loop.state
        if not run.cfg.checkpoint.enabled or not (st.step in self.at or st.stopping):
            return
        loop.sync_model()
        st.last_ckpt = run.step_impl.save(run.ckpt_dir, st.step, st.position(run.plan), run.weights)
        loop.emit("on_checkpoint", st.last_ckpt)


class BestCheckpoint(Callback):
    """``checkpoint.keep_best: METRIC``: after an evaluation that improved METRIC, the model
    is written to ``ckpt-best.pt`` beside the newest checkpoints (atomically; resume and the
    keep-N rule ignore it; ``hpctrain export --best`` reads it)."""

    def on_eval_end(self, loop: "TrainLoop", results: Dict[str, Optional[float]]) -> None:
        run, st = loop.run, loop.state
        task = run.step_impl.task
        if task.best is None or not run.cfg.checkpoint.enabled:
            return
        verdict = task.best.update(results)
        if verdict.improved:
            path = run.step_impl.save_best(run.ckpt_dir, st.step, st.position(run.plan), run.weights)
            run.metrics.write({"kind": "event", "step": st.step, "what": "best_checkpoint",
                               "metric": task.best.metric, "value": verdict.best, "path": path})


class EarlyStopping(Callback):
    """``early_stopping: {metric, mode, patience, min_delta}``: stop (with a checkpoint) when
    METRIC has not improved for ``patience`` evaluations. The scores are all-reduced, so every
    rank takes the same decision at the same step."""

    def on_eval_end(self, loop: "TrainLoop", results: Dict[str, Optional[float]]) -> None:
        run, st = loop.run, loop.state
        stopper = run.step_impl.task.stopper
        if stopper is None:
            return
        verdict = stopper.update(results)
        if verdict.stop and st.step < run.plan.total_steps:
            st.early_stop = True
            st.message = (f"early stopping: {stopper.metric} did not improve by more than {stopper.min_delta} for "
                          f"{stopper.patience} evaluations (best {verdict.best:.4f}); stopped at step {st.step}")
            run.metrics.write({"kind": "event", "step": st.step, "what": "early_stop", "metric": stopper.metric,
                               "best": verdict.best})


class Resources(Callback):
    """The background resource monitor (:mod:`hpctrain.train.monitor`) of this rank, read by
    the loop into the per-step gather (``monitor_interval`` seconds; 0: off)."""

    def __init__(self) -> None:
        self.monitor: Any = None

    def on_fit_start(self, loop: "TrainLoop") -> None:
        run = loop.run
        if run.cfg.monitor_interval <= 0:
            return
        from hpctrain.train.monitor import ResourceMonitor, nvml_reader

        dev = getattr(run.step_impl, "device", None)
        gpu = nvml_reader(dev.index or 0) if dev is not None and dev.type == "cuda" else None
        self.monitor = ResourceMonitor(run.cfg.monitor_interval, gpu=gpu).start()
        loop.monitor = self.monitor

    def close(self, loop: "TrainLoop") -> None:
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None


def builtin_callbacks(run: "Run") -> List[Callback]:
    """The runner's own hooks, in the order they run after a step: merges first (what follows
    sees the merged model), the evaluation's hooks before the checkpoint's (an early stop is
    saved at its step)."""
    from hpctrain.train.averaging import ModelSync

    return [ModelSync(run), Resources(), ProgressBar(), Throughput(run), Evaluation(run), BestCheckpoint(),
            EarlyStopping(), Checkpointing(run)]
