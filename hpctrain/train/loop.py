"""The training loop: epochs of optimizer steps, hooks after each.

One optimizer step, on every rank, in the same order:

1. ``k = sync.backward_passes_per_step`` times: take a batch from the HDF5 loader
   (*data-wait*), forward, masked loss, backward (:mod:`hpctrain.train.steps`: gradient
   buckets start their all-reduce while backward continues);
2. ``optimizer.synchronize()`` — wait for the buckets (*comm*);
3. one small ``allgather`` of per-rank numbers: loss sum and real-sample count (the exact
   global loss), a non-finite flag (NaN/Inf on any rank stops or skips the step on *every*
   rank), a stop flag (preemption signal on any rank stops every rank at the same step),
   and the previous step's timings (metrics, stragglers);
4. ``optimizer.step()`` with the scheduled learning rate;
5. the hooks' ``on_step_end`` (:mod:`hpctrain.train.callbacks`): progress, stragglers,
   evaluation, checkpoint, user callbacks — on every rank, so their collectives match.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hpctrain import comm
from hpctrain.train.averaging import ModelSync
from hpctrain.train.build import Run
from hpctrain.train.callbacks import Callback
from hpctrain.train.metrics import RANK_FIELDS, rss_mb, summarize_ranks
from hpctrain.train.plan import TrainPlan, lr_factor
from hpctrain.train.steps import BatchStats

log = logging.getLogger("hpctrain.train")

# Columns of the per-step gather: what each rank contributes.
G_LOSS, G_REAL, G_NONFINITE, G_STOP, G_CORRECT = range(5)
G_TIMES = 5  # then RANK_FIELDS of the previous step


@dataclass
class LoopState:
    """Where the loop is. ``step``: completed optimizer steps; ``s_in_epoch``: of this epoch."""

    step: int
    epoch: int
    s_in_epoch: int = 0
    last_loss: Optional[float] = None
    last_eval: Dict[str, Optional[float]] = field(
        default_factory=lambda: {"test_accuracy": None, "test_loss": None})
    last_ckpt: Optional[str] = None
    status: str = "completed"      # completed | preempted | stopped | nan
    message: str = ""
    signal: Optional[int] = None
    stop_now: bool = False          # a rank received a stop signal at this step
    debug_stop: bool = False        # debug.stop_at_step reached
    early_stop: bool = False        # early_stopping's patience ran out
    t_train: float = 0.0

    @property
    def stopping(self) -> bool:
        """This step is the last one of the run (a signal or ``debug.stop_at_step``)."""
        return self.stop_now or self.debug_stop or self.early_stop

    def position(self, plan: TrainPlan) -> Tuple[int, int]:
        """(epoch, step in epoch) to resume from after this step."""
        if self.s_in_epoch >= plan.steps_per_epoch:
            return self.epoch + 1, 0
        return self.epoch, self.s_in_epoch


class TrainRecords:
    """The ``kind: train`` records of metrics.jsonl. A step's record is completed by the next
    step's gather, which carries every rank's timings of that step."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.pending: Optional[Dict[str, Any]] = None
        self.wall_start = time.time()

    def begin(self, step: int, epoch: int, rows: np.ndarray, loss: float, lr: float) -> None:
        total_real = float(rows[:, G_REAL].sum())
        train_acc = (float(rows[:, G_CORRECT].sum() / total_real)
                     if total_real and self.run.step_impl.task.classification else None)
        self.pending = {"kind": "train", "step": step, "epoch": epoch, "loss": loss, "train_accuracy": train_acc,
                        "lr": lr, "samples": total_real, "time": time.time() - self.wall_start}

    def finish(self, rows: np.ndarray) -> None:
        if self.pending is None:
            return
        times = rows[:, G_TIMES:]
        rec = self.pending
        per = summarize_ranks(times.tolist())
        rec.update({name: float(times[0, j]) for j, name in enumerate(RANK_FIELDS)})
        rec["compute"] = rec["forward"] + rec["backward"]
        slowest = float(times[:, 0].max())
        rec["step_time_max"] = slowest
        rec["samples_per_s"] = rec["samples"] / slowest if slowest > 0 else 0.0
        rec.update(per)
        self.run.metrics.write(rec)
        tb = self.run.tb
        if tb is not None:
            for key in ("loss", "lr", "samples_per_s", "step_time", "comm", "compute", "rss_mb", "cpu_percent",
                        "gpu_util", "gpu_mem_mb"):
                tb.add_scalar("train/" + key, rec[key], rec["step"])
        self.pending = None


class TrainLoop:
    """Walks a built :class:`Run` to the end or a stop condition; see the module docstring."""

    TIMES = G_TIMES

    def __init__(self, run: Run, callbacks: Sequence[Callback] = ()) -> None:
        self.run = run
        self.state = LoopState(step=run.step, epoch=run.epoch,
                               last_ckpt=str(run.resumed_from) if run.resumed_from is not None else None)
        self.records = TrainRecords(run)
        self.rows = np.zeros((run.world, G_TIMES + len(RANK_FIELDS)))
        self.prev_times = [0.0] * len(RANK_FIELDS)
        self.callbacks: List[Callback] = list(callbacks)
        self.last_step_skipped = False  # NaN/Inf with on_nan: skip: the step was not applied
        self.monitor: Any = None        # the Resources callback's ResourceMonitor, when on

    # ------------------------------------------------------------------ hooks
    def emit(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every callback, in order (every rank does the same)."""
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, *args)

    def sync_model(self) -> None:
        """Make every rank's model the same before it is evaluated or saved (collective)."""
        for cb in self.callbacks:
            if isinstance(cb, ModelSync):
                cb.sync(self)

    def rank_samples(self) -> float:
        """Real samples this rank trained on in the last step (with a pipeline: its replica's
        batch, which only the last stage counts)."""
        run = self.run
        if run.pipe is None:
            return float(self.rows[run.rank, G_REAL])
        return float(run.plan.rank_batch_sizes[run.data_rank] * run.plan.accumulation)

    def resources(self) -> List[float]:
        """RSS, CPU %, GPU % and GPU MiB of this rank from the monitor's latest sample (the
        sampling runs in its own thread; -1: not measured)."""
        if self.monitor is None:
            return [rss_mb(), -1.0, -1.0, -1.0]
        s = self.monitor.latest()
        return [s["rss_mb"], s["cpu_percent"], s["gpu_util"], s["gpu_mem_mb"]]

    def last_rate(self) -> float:
        """Samples per second of the last step (real samples / the slowest rank's step time)."""
        slowest = float(self.rows[:, G_TIMES].max())
        return float(self.rows[:, G_REAL].sum()) / slowest if slowest > 0 else 0.0

    # ------------------------------------------------------------------ the loop
    def run_loop(self) -> LoopState:
        """Train; returns the final state. ``close`` hooks run also after an error."""
        run, st = self.run, self.state
        try:
            self.emit("on_fit_start")
            comm.barrier()
            run.timeline.start_clock()
            st.t_train = time.perf_counter()
            run.step_impl.train()
            skip = run.skip
            while st.step < run.plan.total_steps and st.status == "completed":
                self.run_epoch(skip)
                skip = 0
                if st.status != "completed":
                    break
                if st.s_in_epoch >= run.plan.steps_per_epoch:
                    self.emit("on_epoch_end")
                    st.epoch += 1
            # The last step's timings: one more gather (every rank reaches here together).
            self.records.finish(self.gather(np.array([0.0, 0.0, 0.0, 0.0, 0.0, *self.prev_times])))
        finally:
            self.emit("close")
        return st

    def run_epoch(self, skip: int) -> None:
        """The steps of one epoch; after a resume inside an epoch, from its ``skip``-th step
        (the same order, minus what was done, without reading it)."""
        run, st = self.run, self.state
        run.ds.set_epoch(st.epoch)
        batches = run.ds.iter_from(skip * run.plan.accumulation)
        st.s_in_epoch = skip
        while st.s_in_epoch < run.plan.steps_per_epoch and st.step < run.plan.total_steps:
            if not self.train_step(batches):
                break
            self.emit("on_step_end")
            if st.stopping:
                self.stop()
                break

    def train_step(self, batches: Any) -> bool:
        """One optimizer step; False when the run stops before applying it (NaN/Inf)."""
        run, st = self.run, self.state
        dbg = run.cfg.debug
        run.timeline.step = st.step
        if dbg.fail_at_step == st.step and dbg.fail_rank == run.rank:
            raise RuntimeError(f"debug.fail_at_step={st.step}: injected failure on rank {run.rank} "
                               f"at unix time {time.time():.3f}")
        t_step = time.perf_counter()
        total, t_data, nonfinite = self.forward_backward(batches)
        if dbg.kill_at_step == st.step and dbg.kill_rank == run.rank and comm.generation() == 0:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)  # dies between backward and the gradients' all-reduce
        t4 = time.perf_counter()
        run.opt.synchronize()  # waits for the gradient buckets (no-op for model_average)
        # Stop flag = the signal number this rank received (0: none); any rank -> all stop.
        guard = run.guard
        stop_sig = float(int(guard.received)) if guard is not None and guard.received else 0.0
        rows = self.gather(np.array([total.loss_sum, total.real, float(nonfinite), stop_sig, total.correct,
                                     *self.prev_times]))
        t5 = time.perf_counter()
        run.timeline.add("comm-wait", t4, t5)
        self.records.finish(rows)  # the previous step's record now has every rank's timings
        self.rows = rows
        self.last_step_skipped = bool(rows[:, G_NONFINITE].any())
        if self.last_step_skipped and not self.skip_nonfinite(rows):
            return False
        if not self.last_step_skipped:
            self.optimizer_step()
        t_end = time.perf_counter()
        self.prev_times = [t_end - t_step, t_data, total.forward, total.backward, t5 - t4 + total.comm, t_end - t5,
                           *self.resources()]
        total_real = float(rows[:, G_REAL].sum())
        st.last_loss = float(rows[:, G_LOSS].sum() / total_real) if total_real else float("nan")
        self.records.begin(st.step + 1, st.epoch, rows, st.last_loss, float(run.opt.param_groups[0]["lr"]))
        st.step += 1
        st.s_in_epoch += 1
        st.stop_now = bool(rows[:, G_STOP].any())
        st.debug_stop = dbg.stop_at_step >= 0 and st.step >= dbg.stop_at_step
        return True

    def forward_backward(self, batches: Any) -> Tuple[BatchStats, float, bool]:
        """``k`` batches through the model: their summed stats, the seconds waited for data,
        and whether a loss was NaN/Inf."""
        run, st = self.run, self.state
        dbg = run.cfg.debug
        total, t_data = BatchStats(), 0.0
        scale = run.data_world / run.plan.global_batch
        inject_nan = dbg.nan_at_step == st.step and dbg.nan_rank == run.rank
        nonfinite = False
        for _micro in range(run.plan.accumulation):
            t0 = time.perf_counter()
            batch = next(batches)
            t1 = time.perf_counter()
            run.timeline.add("data-wait", t0, t1)
            t_data += t1 - t0
            if dbg.slow_rank == run.rank and dbg.slow_ms > 0:
                time.sleep(dbg.slow_ms / 1000.0)
                total.forward += time.perf_counter() - t1
            got = run.step_impl.forward_backward(batch, scale, inject_nan)
            nonfinite = nonfinite or not np.isfinite(got.loss_sum)
            total.loss_sum += got.loss_sum
            total.real += got.real
            total.correct += got.correct
            total.forward += got.forward
            total.backward += got.backward
            total.comm += got.comm
        return total, t_data, nonfinite

    def optimizer_step(self) -> None:
        """The scheduled learning rate, then the step (gradients already synchronized)."""
        run = self.run
        lr_now = run.plan.lr * lr_factor(self.state.step, run.plan.total_steps, run.cfg.schedule)
        for g in run.opt.param_groups:
            g["lr"] = lr_now
        t6 = time.perf_counter()
        if self.prepare_gradients():
            with run.opt.skip_synchronize():
                run.opt.step()
        run.opt.zero_grad()
        run.timeline.add("optimizer", t6, time.perf_counter())

    def prepare_gradients(self) -> bool:
        """After the all-reduce, before the step: fp16's agreed overflow check (False: every
        rank skips this step) and clipping of the global gradient (Horovod's synchronize(),
        clip, skip_synchronize() idiom, done for the user)."""
        run, cfg = self.run, self.run.cfg
        task = run.step_impl.task
        if task.scaler is None and cfg.clip_grad_norm <= 0 and cfg.clip_grad_value <= 0:
            return True  # the default: nothing to do on the step's path
        params = [p for p in run.model.parameters() if p.grad is not None]
        if task.scaler is not None and not task.scaler.unscale_and_check(params):
            if run.rank == 0:
                log.info("fp16: gradient overflow at step %d on some rank; step skipped on every rank, "
                         "loss scale now %g", self.state.step, task.scaler.scale)
            return False
        if cfg.clip_grad_norm > 0 or cfg.clip_grad_value > 0:
            from hpctrain.train.clipping import clip_gradients

            stages = None
            if run.pipe is not None:
                # Replicas hold equal gradients after their all-reduce: the world's sum counts
                # every stage data_world times.
                stages = lambda local: float(comm.allreduce(np.array([local]), op="sum")[0]) / run.data_world  # noqa: E731
            clip_gradients(params, cfg.clip_grad_norm, cfg.clip_grad_value, squared_norm_sum=stages)
        return True

    def skip_nonfinite(self, rows: np.ndarray) -> bool:
        """NaN/Inf on some rank: skip the step on every rank (True) or stop the run (False)."""
        run, st = self.run, self.state
        bad = [int(r) for r in np.flatnonzero(rows[:, G_NONFINITE])]
        where = f"step {st.step} (epoch {st.epoch})"
        if run.cfg.on_nan == "skip":
            run.opt.zero_grad()
            if run.rank == 0:
                log.warning("non-finite loss at %s on rank(s) %s: step skipped (on_nan: skip)", where, bad)
            run.metrics.write({"kind": "event", "step": st.step, "what": "nan_skip", "ranks": bad})
            return True
        st.status = "nan"
        st.message = (f"loss is NaN/Inf at {where} on rank(s) {bad}; training stopped before "
                      f"applying that step. Last good checkpoint: {st.last_ckpt or 'none written yet'}.\n"
                      "HINT: lower optimizer.lr or add schedule.warmup_steps, check the data "
                      "(hpctrain data verify), or set on_nan: skip to skip such steps")
        run.metrics.write({"kind": "event", "step": st.step, "what": "nan_stop", "ranks": bad})
        return False

    def stop(self) -> None:
        """A stop signal or ``debug.stop_at_step``: the checkpoint hook has saved this step."""
        st = self.state
        if st.stop_now:
            st.status = "preempted"
            st.signal = int(self.rows[:, G_STOP].max())
            st.message = (f"stop signal received: checkpoint {st.last_ckpt} written at step {st.step}; "
                          "rerun with --resume auto to continue")
        elif st.early_stop:
            st.status = "stopped"     # early_stopping's message says why
        else:
            st.status = "stopped"
            st.message = f"debug.stop_at_step={self.run.cfg.debug.stop_at_step}: stopped at step {st.step}"

    def gather(self, row: np.ndarray) -> np.ndarray:
        """Every rank's row of per-step numbers, as a (world, fields) array."""
        # It runs right after synchronize() (nothing in flight) at the same point of the same
        # loop on every rank, so it skips comm's per-collective agreement round trip (a second
        # message exchange per step; the stall watchdog still guards it). The gradient
        # all-reduces keep their checks.
        was = comm.checks_enabled()
        comm.set_checks(False)
        try:
            return np.asarray(comm.allgather(row.reshape(1, -1))).reshape(self.run.world, -1)
        finally:
            comm.set_checks(was)
