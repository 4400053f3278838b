"""One training step's model work, as two objects with one interface.

- :class:`DataParallelStep`: the whole model on every rank; the gradient buckets of
  :class:`hpctrain.torch.DistributedOptimizer` all-reduce during backward.
- :class:`PipelineStep`: ``parallel: {pipeline_stages: S, …}``; each rank holds one stage
  (:mod:`hpctrain.parallel`), a batch runs through the GPipe/1F1B schedule, each stage's
  gradients are averaged over its data-parallel group. Checks and checkpoint files of this
  mode live in :mod:`hpctrain.train.pipeline`.

Both take a batch with :meth:`forward_backward` (masked-sum loss scaled by data-parallel
world / global batch, so that after the average over ranks or replicas the gradient is the
global batch-mean loss's, exact with unequal per-rank batches), evaluate exactly
(:meth:`evaluate`: sums all-reduced, padding ignored), save and restore checkpoints. The loop
(:mod:`hpctrain.train.loop`) never asks which one it has.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from hpctrain import comm
from hpctrain.train import checkpoint as ckpt
from hpctrain.train import pipeline as pp
from hpctrain.train.build import make_optimizer, sync_name
from hpctrain.train.config import TrainConfig
from hpctrain.train.plan import TrainPlan
from hpctrain.train.timeline import Timeline

log = logging.getLogger("hpctrain.train")


@dataclass
class BatchStats:
    """What one batch gave on this rank: loss sum and real (non-padding) samples, correct
    predictions (classification), and its seconds of forward, backward and pipeline messages."""

    loss_sum: float = 0.0
    real: float = 0.0
    correct: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    comm: float = 0.0


def eval_result(cfg: TrainConfig, total: np.ndarray) -> Dict[str, Optional[float]]:
    """The eval record from all-reduced sums ``[loss sum, correct, count]``."""
    n = float(total[2])
    res: Dict[str, Optional[float]] = {"test_samples": n}
    res["test_loss"] = float(total[0] / n) if n and "loss" in cfg.eval.metrics else None
    res["test_accuracy"] = (float(total[1] / n) if n and "accuracy" in cfg.eval.metrics
                            and cfg.loss == "cross_entropy" else None)
    return res


class LocalOptimizer:
    """A torch optimizer with DistributedOptimizer's step protocol and no communication:
    ``sync.strategy: model_average`` steps each rank alone; the runner merges the models."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def synchronize(self) -> None:
        """Nothing to wait for: gradients stay local."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield

    def step(self) -> Any:
        return self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class DataParallelStep:
    """The whole model on this rank; gradients all-reduced by the optimizer's buckets."""

    pipe = None

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, device: torch.device, world: int,
                 rank: int) -> None:
        self.cfg, self.module, self.device = cfg, model, device
        self.data_rank, self.data_world = rank, world
        self.buffer_group: Any = None  # buffers agree over the world
        self.opt: Any = None
        self.run_id = ""  # set by build_run (rank 0's, carried through resumes)
        self.timeline: Optional[Timeline] = None
        model.to(device)

    def build_optimizer(self, lr: float) -> None:
        import hpctrain.torch as hvd

        cfg = self.cfg
        if cfg.sync.strategy == "model_average":
            self.opt = LocalOptimizer(make_optimizer(cfg, self.module.parameters(), lr))
            return
        self.opt = hvd.DistributedOptimizer(
            make_optimizer(cfg, self.module.parameters(), lr), named_parameters=self.module.named_parameters(),
            compression=getattr(hvd.Compression, cfg.sync.compression),
            backward_passes_per_step=cfg.sync.backward_passes_per_step, sync=sync_name(cfg),
            backend=cfg.sync.backend, fusion_threshold=cfg.sync.fusion_threshold)

    def loader_keys(self) -> List[str]:
        return [*self.cfg.data.x_keys, self.cfg.data.keys["y"]]

    def train(self) -> None:
        self.module.train()

    def forward_backward(self, batch: Dict[str, torch.Tensor], scale: float, inject_nan: bool) -> BatchStats:
        cfg, dev = self.cfg, self.device
        yk = cfg.data.keys["y"]
        t1 = time.perf_counter()
        xs = [batch[k].to(dev, non_blocking=True) for k in cfg.data.x_keys]
        y, mask = batch[yk].to(dev, non_blocking=True), batch["mask"].to(dev, non_blocking=True)
        out = self.task.forward(self.module, *xs)
        per_sample = self.task.loss(out, y)
        m = mask.to(per_sample.dtype)
        local_sum = (per_sample * m).sum()
        if inject_nan:
            local_sum = local_sum * float("nan")
        loss = local_sum * scale
        if self.task.scaler is not None:
            loss = self.task.scaler.scale_loss(loss)
        t2 = time.perf_counter()
        self.timeline.add("forward", t1, t2)
        loss.backward()
        t3 = time.perf_counter()
        self.timeline.add("backward", t2, t3)
        correct = self.task.correct(out, y, mask)
        return BatchStats(loss_sum=float(local_sum.detach()), real=float(m.sum()), correct=correct,
                          forward=t2 - t1, backward=t3 - t2)

    def evaluate(self, test_ds: Any) -> Dict[str, Optional[float]]:
        """Exact metrics over the whole test set: padding ignored, sums all-reduced."""
        t0 = time.perf_counter()
        cfg, dev = self.cfg, self.device
        yk = cfg.data.keys["y"]
        self.module.eval()
        acc = self.task.accumulator()
        with torch.no_grad():
            for batch in test_ds:
                out = self.task.forward(self.module, *[batch[k].to(dev, non_blocking=True) for k in cfg.data.x_keys])
                y, mask = batch[yk].to(dev, non_blocking=True), batch["mask"].to(dev, non_blocking=True)
                acc.update(out.float(), y, mask)
        self.module.train()
        results = self.task.reduce(acc)
        self.timeline.add("eval", t0, time.perf_counter())
        return results

    def save(self, ckpt_dir: Path, step: int, pos: Tuple[int, int], weights: Optional[List[float]]) -> str:
        """Collective: rank 0 writes the checkpoint (every rank's RNG state in it)."""
        t0 = time.perf_counter()

        def write(state: Dict[str, Any]) -> str:
            return str(ckpt.save(ckpt_dir, state, self.cfg.checkpoint.keep).path)

        path = self._write_on_rank0(step, pos, weights, write)
        self.timeline.add("checkpoint", t0, time.perf_counter())
        return path

    def save_best(self, ckpt_dir: Path, step: int, pos: Tuple[int, int], weights: Optional[List[float]]) -> str:
        """Collective: rank 0 writes ``ckpt-best.pt`` atomically (outside the keep-N set)."""
        path = Path(ckpt_dir) / "ckpt-best.pt"

        def write(state: Dict[str, Any]) -> str:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                ckpt.atomic_save(state, path)
            except OSError as exc:
                raise ckpt.CheckpointError(f"cannot write the best checkpoint {path}: {exc}") from exc
            return str(path)

        return self._write_on_rank0(step, pos, weights, write)

    def _write_on_rank0(self, step: int, pos: Tuple[int, int], weights: Optional[List[float]],
                        write: Any) -> str:
        """Collective: every rank's RNG state to rank 0, which builds the checkpoint and
        ``write``s it; every rank gets the path, or raises the same CheckpointError."""
        rngs = comm.allgather_object(ckpt.capture_rng())
        result: Any = None
        if comm.rank() == 0:
            state = ckpt.build_state(step=step, epoch=pos[0], step_in_epoch=pos[1], model=self.module,
                                     optimizer=self.opt, scheduler={"kind": self.cfg.schedule.kind, "step": step},
                                     rng=rngs, config=self.cfg.to_dict(), run_id=self.run_id,
                                     extra={"balance_weights": weights, "scheduler_step": step, **self.task.state()})
            try:
                result = ("ok", write(state))
            except ckpt.CheckpointError as exc:
                result = ("error", str(exc))
        result = comm.broadcast_object(result, root=0)
        if result[0] == "error":
            raise ckpt.CheckpointError(result[1])
        return result[1]

    def restore(self, state: Dict[str, Any], path: Path) -> None:
        from hpctrain.train import checks

        checks.load_model_state(self.module, state["model"], path, state.get("config", {}).get("model"))
        self.opt.load_state_dict(state["optimizer"])


class PipelineStep:
    """This rank's stage of a pipeline; a batch goes through the schedule, the loss exists on
    the last stage (the other stages report zeros, so the per-step gather counts it once)."""

    def __init__(self, cfg: TrainConfig, model: Any, plan: TrainPlan, device: torch.device, world: int,
                 rank: int) -> None:
        pc = pp.parallel_config(cfg)
        self.cfg, self.device, self.rank = cfg, device, rank
        self.pipe = pc.build(model, sample_input=sample_input(cfg, pc, plan.batch_size),
                             device=None if device.type == "cpu" else device)
        self.data_rank, self.data_world = self.pipe.replica, self.pipe.layout.data_parallel
        self.module = self.pipe.module  # this rank's stage: what the optimizer steps
        self.buffer_group = self.pipe.data_parallel_group  # a stage's buffers agree over its replicas
        self.opt: Any = None
        self.run_id = ""  # set by build_run (rank 0's, carried through resumes)
        self.timeline: Optional[Timeline] = None
        if rank == 0:
            log.info("pipeline: %d stages x %d data-parallel replicas, %s schedule, %d micro-batches of a "
                     "%d-row replica batch; stage split %s", self.pipe.stages, self.data_world, self.pipe.schedule,
                     self.pipe.micro_batches, plan.batch_size, self.pipe.plan.describe())

    def build_optimizer(self, lr: float) -> None:
        import hpctrain.torch as hvd
        from hpctrain.parallel import distributed_optimizer

        cfg, pipe = self.cfg, self.pipe
        named = list(self.module.named_parameters())
        if not any(p.requires_grad for _, p in named):
            # A stage without trainable parameters (only Flatten, pooling, activations, …).
            # torch optimizers refuse an empty list; a zero-size placeholder keeps one code path
            # (param_groups for the lr, state_dict for checkpoints) at no cost. It lives outside
            # the stage module, so checkpoints and the merged state_dict do not contain it.
            placeholder = torch.nn.Parameter(torch.zeros(0, device=self.device))
            named = [("pipeline.stage%d.placeholder" % pipe.stage, placeholder)]
            log.warning("pipeline stage %d (rank %d) holds no trainable parameters (layers %s)\n"
                        "HINT: set parallel.split_points to give every stage some work", pipe.stage, self.rank,
                        pipe.layer_names)
            inner = make_optimizer(cfg, [placeholder], lr)
        else:
            inner = make_optimizer(cfg, self.module.parameters(), lr)
        # Each stage's gradients are averaged over its data-parallel group; one backward
        # pass per micro-batch, k batches per step.
        self.opt = distributed_optimizer(
            pipe, inner, named_parameters=named, compression=getattr(hvd.Compression, cfg.sync.compression),
            backward_passes_per_step=cfg.sync.backward_passes_per_step * pipe.micro_batches,
            fusion_threshold=cfg.sync.fusion_threshold)

    def loader_keys(self) -> List[str]:
        xk, yk = self.cfg.data.x_key, self.cfg.data.keys["y"]
        return pp.loader_keys(self.pipe.stage, self.pipe.stages, xk, yk)

    def train(self) -> None:
        self.pipe.train()

    def _targets(self, batch: Dict[str, torch.Tensor]) -> Tuple[Optional[torch.Tensor], pp.Targets]:
        xk, yk = self.cfg.data.x_key, self.cfg.data.keys["y"]
        mask = batch["mask"]
        x = self.task.prepare(batch[xk]) if self.pipe.is_first else None
        return x, (pp.Targets(batch[yk], mask) if self.pipe.is_last else pp.Targets(mask, mask))

    def forward_backward(self, batch: Dict[str, torch.Tensor], scale: float, inject_nan: bool) -> BatchStats:
        cfg = self.cfg
        sums = [0.0, 0.0, 0.0]

        def loss_fn(out: torch.Tensor, t: pp.Targets) -> torch.Tensor:
            per = self.task.loss(out, t.y)
            m = t.mask.to(per.dtype)
            local = (per * m).sum()
            if inject_nan:
                local = local * float("nan")
            sums[0] += float(local.detach())
            sums[1] += float(m.sum())
            sums[2] += self.task.correct(out, t.y, t.mask)
            loss = local * scale
            return self.task.scaler.scale_loss(loss) if self.task.scaler is not None else loss

        t1 = time.perf_counter()
        x, targets = self._targets(batch)
        self.pipe.train_step(x, targets, loss_fn, rows_weighted=False)
        self.timeline.add("pipeline", t1, time.perf_counter())
        stats = self.pipe.last_stats
        # forward + backward of the stage count as forward
        return BatchStats(loss_sum=sums[0], real=sums[1], correct=sums[2], forward=stats.compute_seconds,
                          comm=stats.comm_seconds)

    def evaluate(self, test_ds: Any) -> Dict[str, Optional[float]]:
        """Exact metrics through the pipeline: sums on the last stages, all-reduced."""
        t0 = time.perf_counter()
        cfg, pipe = self.cfg, self.pipe
        pipe.eval()
        acc = self.task.accumulator()

        def loss_fn(out: torch.Tensor, t: pp.Targets) -> torch.Tensor:
            acc.update(out.float(), t.y, t.mask)
            return self.task.loss(out, t.y).sum()

        for batch in test_ds:
            x, targets = self._targets(batch)
            pipe.evaluate(x, targets, loss_fn, rows_weighted=False,
                          micro_batches=max(1, min(pipe.micro_batches, len(batch["mask"]))))
        pipe.train()
        results = self.task.reduce(acc)
        self.timeline.add("eval", t0, time.perf_counter())
        return results

    def save(self, ckpt_dir: Path, step: int, pos: Tuple[int, int], weights: Optional[List[float]]) -> str:
        """Collective: one file per stage and ``meta.pt`` (data shares are not re-weighted here)."""
        t0 = time.perf_counter()
        meta = pp.build_meta(step=step, epoch=pos[0], step_in_epoch=pos[1], pipe=self.pipe,
                             config=self.cfg.to_dict(), run_id=self.run_id,
                             extra={"balance_weights": None, "scheduler_step": step, **self.task.state()})
        path = pp.save(ckpt_dir, self.pipe, self.opt, meta, self.cfg.checkpoint.keep)
        self.timeline.add("checkpoint", t0, time.perf_counter())
        return path

    def restore(self, state: Dict[str, Any], path: Path) -> None:
        pp.load(path, self.pipe, self.opt)


def sample_input(cfg: TrainConfig, pc: Any, batch_size: int) -> Optional[torch.Tensor]:
    """One micro-batch of zeros shaped like the data, for ``parallel.balance: time``."""
    if pc.balance != "time" or pc.split_points is not None or pc.sizes is not None:
        return None
    from hpctrain.data.h5files import describe, expand_paths
    from hpctrain.data.loader import _torch_dtype

    xk = cfg.data.x_key
    info = describe(expand_paths(list(cfg.data.train))[0], [xk])
    dtype = _torch_dtype(cfg.data.dtypes.get("x", "float32")) or torch.float32
    return torch.zeros((max(1, batch_size // pc.micro_batches), *info.keys[xk].shape[1:])).to(dtype)


def build_step(cfg: TrainConfig, model: Any, plan: TrainPlan, device: torch.device, world: int,
               rank: int) -> Any:
    """The step object of this run: a pipeline with ``parallel.pipeline_stages > 1``."""
    if pp.parallel_config(cfg).enabled:
        return PipelineStep(cfg, model, plan, device, world, rank)
    return DataParallelStep(cfg, model, device, world, rank)
