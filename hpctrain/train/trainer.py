"""``Trainer(config).fit()``: build a run, walk its loop, report how it ended.

The parts, top to bottom: :mod:`hpctrain.train.build` (model, optimizer, resume, data,
outputs), :mod:`hpctrain.train.steps` (one data-parallel or pipeline step), the loop
(:mod:`hpctrain.train.loop`) and the hooks after a step, an evaluation or an epoch
(:mod:`hpctrain.train.callbacks`: progress, stragglers and re-balancing, evaluation,
checkpoints, user callbacks). Checkpoints, evaluation and re-balancing happen at the same step
on every rank, so the collectives always match. See docs/train.md.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, List, Optional

import hpctrain
from hpctrain import comm
from hpctrain.train import elastic
from hpctrain.train import pipeline as pp
from hpctrain.train.build import (Run, build_run, data_counts, import_factory, init_process, make_optimizer,
                                  per_sample_loss, resolve_batch_size, resolve_device)
from hpctrain.train.callbacks import builtin_callbacks, load_callbacks
from hpctrain.train.config import TrainConfig
from hpctrain.train.loop import LoopState, TrainLoop
from hpctrain.train.plan import TrainPlan, make_plan, rank_weights
from hpctrain.train.timeline import chrome_trace, write_trace

__all__ = ["Trainer", "FitResult", "NonFiniteLossError", "import_factory", "data_counts", "make_optimizer",
           "per_sample_loss", "resolve_batch_size", "resolve_device"]

log = logging.getLogger("hpctrain.train")


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf (``on_nan: stop``)."""


@dataclass
class FitResult:
    """How :meth:`Trainer.fit` ended."""

    status: str                      # completed | preempted | stopped | nan
    step: int
    epoch: int
    run_dir: str
    checkpoint: Optional[str]
    final_loss: Optional[float]
    test_accuracy: Optional[float]
    test_loss: Optional[float]
    wall_s: float
    message: str = ""
    signal: Optional[int] = None
    requeued: bool = False


def _keys_from_data(cfg: TrainConfig) -> None:
    """``data.keys`` of a config that names none: the roles ``hpctrain data pack`` recorded."""
    if cfg.data.keys:
        return
    from hpctrain.data import roles
    from hpctrain.data.h5files import expand_paths

    first = expand_paths(list(cfg.data.train))[0]
    cfg.data.resolve_keys(roles(first))
    log.info("data.keys from %s: x=%s, y=%s", first, cfg.data.keys["x"], cfg.data.keys["y"])


def _node_of_rank(cfg: TrainConfig, world_size: int) -> Optional[List[int]]:
    """Every rank's node index, when weights are given per node and the world is running
    (collective then; the same decision on every rank); None otherwise."""
    if len(cfg.data.weights) == world_size or not comm.is_initialized() or comm.size() != world_size:
        return None
    return [int(n) for n in comm.allgather_object(comm.cross_rank())]


class Trainer:
    """Train ``config`` on the ranks of the current MPI job (or alone).

    ``resume``: None (start fresh; refuses a checkpoint directory that already holds
    checkpoints), ``"auto"`` (the newest checkpoint that loads, else start fresh), or a
    checkpoint path. A run requeued by SLURM (``SLURM_RESTART_COUNT`` >= 1) resumes
    automatically.
    """

    def __init__(self, config: TrainConfig, *, resume: Optional[str] = None) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"Trainer needs a TrainConfig, got {type(config).__name__}; "
                            "HINT: hpctrain.train.load_config('run.yaml')")
        self.cfg = config
        _keys_from_data(config)
        if resume is None and int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) >= 1:
            resume = "auto"
        self.resume = resume
        self.run_dir = Path(config.run_dir)
        self.plan: Optional[TrainPlan] = None
        self.pipe: Any = None  # the PipelineModule of a parallel.pipeline_stages > 1 run

    # ------------------------------------------------------------------ planning
    def make_plan(self, world_size: Optional[int] = None) -> TrainPlan:
        """The plan for ``world_size`` ranks (default: the current world). Reads file metadata only.

        With a pipeline (``parallel.pipeline_stages`` S > 1) the data is planned over the
        ``world_size // S`` data-parallel replicas; a world that cannot hold the stages is a
        ConfigError here, before any communication."""
        cfg = self.cfg
        pc = pp.parallel_config(cfg)
        pp.check_runner_options(cfg, pc)
        if world_size is None:
            comm.init()
            world_size = comm.size()
        data_world = pp.check_world(pc, world_size) if pc.enabled else world_size
        keys = [*cfg.data.x_keys, cfg.data.keys["y"]]
        train = data_counts(cfg.data.train, keys)
        test = data_counts(cfg.data.test, keys) if cfg.data.test else []
        b = resolve_batch_size(cfg, sum(train) // max(1, data_world))
        weights = None
        if cfg.data.policy == "weighted":
            weights = rank_weights(cfg.data.weights, data_world, _node_of_rank(cfg, data_world),
                                   per_node=not pc.enabled)
        plan = make_plan(cfg, train, test, data_world, b, weights)
        if pc.enabled:
            pp.check_batch(pc, plan.rank_batch_sizes)
        return plan

    # ------------------------------------------------------------------ fit
    def fit(self) -> FitResult:
        """Train to the end (or a stop condition); returns how it ended.

        With ``elastic.min_ranks`` (a job started with ``hpctrain launch --elastic``), a lost
        rank does not end the run: the survivors re-form the world, resume from the last
        checkpoint with the data planned over them, and go on (``_recover``)."""
        t_begin = time.perf_counter()
        rank, world = init_process(self.cfg)
        elastic.check_job(self.cfg)
        user_callbacks = load_callbacks(self.cfg.callbacks)
        resume, losses = self.resume, []
        while True:
            self.rank, self.world = rank, world
            self.plan = self.make_plan(world)  # every rank computes the same one
            run = build_run(self.cfg, resume, self.plan, rank, world, continuing=bool(losses))
            elastic.record_losses(run, losses)
            self.pipe, self.device = run.pipe, run.step_impl.device
            loop = TrainLoop(run, builtin_callbacks(run) + user_callbacks)
            try:
                state = loop.run_loop()
            except comm.HorovodInternalError as exc:
                if not elastic.recoverable(self.cfg, exc):
                    raise
                losses.append(elastic.recover(self.cfg, run, loop.state.step))
                rank, world, resume = comm.rank(), comm.size(), "auto"
                continue
            finally:
                run.close()
            break
        self.plan = run.plan
        result = self._result(run, state, t_begin)
        loop.emit("on_fit_end", result)
        self._write_summary(run, state, result, losses)
        return result

    # ------------------------------------------------------------------ the end
    def _result(self, run: Run, st: LoopState, t_begin: float) -> FitResult:
        requeued = False
        if st.status == "preempted" and run.rank == 0 and run.guard is not None:
            requeued = run.guard.requeue(rank=run.rank)
        wall = time.perf_counter() - t_begin
        self._write_timeline(run)
        return FitResult(status=st.status, step=st.step, epoch=st.epoch, run_dir=str(self.run_dir),
                         checkpoint=st.last_ckpt, final_loss=st.last_loss,
                         test_accuracy=st.last_eval.get("test_accuracy"), test_loss=st.last_eval.get("test_loss"),
                         wall_s=wall, message=st.message, signal=st.signal, requeued=requeued)

    def _write_summary(self, run: Run, st: LoopState, result: FitResult, losses: List[dict]) -> None:
        """The closing event and summary.json (rank 0); closes the metrics outputs."""
        if run.rank == 0:
            run.metrics.write({"kind": "event", "step": st.step, "what": st.status, "message": st.message})
            summary = {"result": asdict(result), "plan": asdict(run.plan), "world_size": run.world,
                       "ranks_lost": losses,
                       "train_seconds": time.perf_counter() - st.t_train, "hpctrain_version": hpctrain.__version__,
                       "config": self.cfg.to_dict()}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        run.metrics.close()
        if run.tb is not None:
            run.tb.close()
        if st.status == "nan" and run.rank == 0:
            log.error("%s", st.message)

    def _write_timeline(self, run: Run) -> None:
        if not self.cfg.timeline:
            return
        tag = 9123
        if run.rank == 0:
            per_rank = [run.timeline.events]
            for r in range(1, run.world):
                per_rank.append(comm.recv_object(source=r, tag=tag))
            write_trace(self.run_dir / "timeline.json", chrome_trace(per_rank))
        else:
            comm.send_object(run.timeline.events, dest=0, tag=tag)
