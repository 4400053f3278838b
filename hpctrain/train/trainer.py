"""``Trainer(config).fit()``: the training loop over hpctrain's layers.

One optimizer step, on every rank, in the same order:

1. ``k = sync.backward_passes_per_step`` times: take a batch from the HDF5 loader
   (*data-wait*), forward, masked loss, backward (gradient buckets start their all-reduce
   while backward continues);
2. ``optimizer.synchronize()`` — wait for the buckets (*comm*);
3. one small ``allgather`` of per-rank numbers: loss sum and real-sample count (the exact
   global loss), a non-finite flag (NaN/Inf on any rank stops or skips the step on *every*
   rank), a stop flag (preemption signal on any rank stops every rank at the same step),
   and the previous step's timings (metrics, stragglers);
4. ``optimizer.step()`` with the scheduled learning rate.

Checkpoints, evaluation and re-balancing happen at the same step on every rank, so the
collectives always match. See docs/train.md.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

import hpctrain
from hpctrain import comm
from hpctrain.train import checkpoint as ckpt
from hpctrain.train import checks
from hpctrain.train import pipeline as pp
from hpctrain.train.config import ConfigError, TrainConfig
from hpctrain.train.metrics import (RANK_FIELDS, MetricsWriter, StragglerDetector, rebalance_weights, rss_mb,
                                    summarize_ranks)
from hpctrain.train.plan import TrainPlan, eval_batch_size, lr_factor, make_plan, schedule_points
from hpctrain.train.timeline import Timeline, TracingBackend, chrome_trace, write_trace

log = logging.getLogger("hpctrain.train")

# Columns of the per-step gather: what each rank contributes.
_G_LOSS, _G_REAL, _G_NONFINITE, _G_STOP, _G_CORRECT = range(5)
_G_TIMES = 5  # then RANK_FIELDS of the previous step


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


def import_factory(spec: str) -> Callable[..., Any]:
    """``"pkg.module:fn"`` or ``"path/to/file.py:fn"`` -> the callable."""
    mod_name, _, fn_name = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise ConfigError(f"model.factory: file {mod_name!r} does not exist")
            unique = "hpctrain_user_model_" + str(abs(hash(str(path.resolve()))))
            mod_spec = importlib.util.spec_from_file_location(unique, path)
            module = importlib.util.module_from_spec(mod_spec)  # type: ignore[arg-type]
            sys.modules[unique] = module
            mod_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"model.factory: cannot import {mod_name!r} ({exc})\n"
                          "HINT: use an importable module (pip install -e your package) or a file path "
                          "like 'examples/models.py:cnn'") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"model.factory: {mod_name!r} has no callable {fn_name!r}" + checks.callable_hint(module, fn_name))
    return fn


def data_counts(paths: Sequence[str], keys: Sequence[str]) -> List[int]:
    """Sample count of each file (reads only HDF5 metadata)."""
    from hpctrain.data.h5files import describe, expand_paths

    return [describe(p, keys).num_samples for p in expand_paths(list(paths))]


def make_optimizer(cfg: TrainConfig, params: Any, lr: float) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg.optimizer`` over ``params``."""
    o = cfg.optimizer
    params = [p for p in params if p.requires_grad]
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay,
                               nesterov=o.nesterov)
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)


def per_sample_loss(cfg: TrainConfig, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss of every sample of the batch (weighted by the padding mask by the caller)."""
    if cfg.loss == "cross_entropy":
        return F.cross_entropy(out, y.long(), reduction="none")
    diff = (out - y.to(out.dtype).reshape(out.shape)) ** 2
    return diff.reshape(diff.shape[0], -1).mean(dim=1)


def resolve_batch_size(cfg: TrainConfig, max_batch: int) -> int:
    """``batch_size`` as an int; ``"auto"`` runs hpctrain.probe's tuner (collective: every rank
    calls it): the largest per-rank batch whose training step fits in memory on every rank,
    capped at ``max_batch`` (the samples each rank has)."""
    if cfg.batch_size != "auto":
        return int(cfg.batch_size)
    from hpctrain.data.h5files import describe, expand_paths
    from hpctrain.data.loader import _torch_dtype
    from hpctrain.probe import tune_batch_size

    xk, yk = cfg.data.keys["x"], cfg.data.keys["y"]
    info = describe(expand_paths(list(cfg.data.train))[0], [xk, yk])
    xshape, yshape = info.keys[xk].shape[1:], info.keys[yk].shape[1:]
    xdt = _torch_dtype(cfg.data.dtypes.get("x", "float32")) or torch.float32
    factory = import_factory(cfg.model.factory)

    def make_batch(b: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand((b, *xshape)).to(xdt)
        y = torch.zeros((b,), dtype=torch.long) if cfg.loss == "cross_entropy" else torch.zeros((b, *yshape))
        return x, y

    res = tune_batch_size(lambda: factory(**cfg.model.kwargs), make_batch,
                          lambda params: make_optimizer(cfg, params, cfg.optimizer.lr),
                          lambda out, y: per_sample_loss(cfg, out, y).mean(),
                          base_lr=cfg.optimizer.lr, base_batch=1, lr_rule="none", max_batch=max(1, max_batch),
                          accumulation_steps=cfg.sync.backward_passes_per_step)
    if comm.rank() == 0:
        log.info("batch_size: auto -> %d per rank\n%s", res.per_device_batch, res.explanation)
    return int(res.per_device_batch)


def resolve_device(requested: str) -> torch.device:
    """``auto``: this rank's GPU (local rank modulo the visible GPUs) when CUDA is available,
    else the CPU; ``cuda`` insists on a GPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device: cuda, but torch sees no CUDA device on this rank\n"
                          "HINT: set device: auto (falls back to the CPU) or check CUDA_VISIBLE_DEVICES")
    index = comm.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _auto_threads(cfg: TrainConfig) -> None:
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
        return
    if os.environ.get("OMP_NUM_THREADS"):
        return
    per_node = max(1, comm.local_size())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or cores) // per_node))


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
        keys = [cfg.data.keys["x"], cfg.data.keys["y"]]
        train = data_counts(cfg.data.train, keys)
        test = data_counts(cfg.data.test, keys) if cfg.data.test else []
        b = resolve_batch_size(cfg, sum(train) // max(1, data_world))
        plan = make_plan(cfg, train, test, data_world, b)
        if pc.enabled:
            pp.check_batch(pc, plan.rank_batch_sizes)
        return plan

    # ------------------------------------------------------------------ fit
    def fit(self) -> FitResult:
        """Train to the end (or a stop condition); returns how it ended. See the module docstring."""
        import hpctrain.torch as hvd
        from hpctrain.data import HDF5Dataset

        cfg = self.cfg
        t_begin = time.perf_counter()
        hvd.init()
        rank, world = comm.rank(), comm.size()
        self.rank, self.world = rank, world
        _auto_threads(cfg)
        if cfg.deterministic:
            # cuDNN autotuning picks kernels by timing: off for reproducible runs. (CPU kernels
            # are deterministic for a fixed thread count.)
            torch.backends.cudnn.benchmark = False
            torch.backends.cudnn.deterministic = True

        # -- the plan (every rank computes the same one) --------------------------
        pc = pp.parallel_config(cfg)
        plan = self.make_plan(world)
        self.plan = plan
        data_rank, data_world = rank, world  # who shares the data: ranks, or pipeline replicas
        xk, yk = cfg.data.keys["x"], cfg.data.keys["y"]
        dtypes = {cfg.data.keys[role]: dt for role, dt in cfg.data.dtypes.items()}

        # -- model: same seed everywhere, then rank 0's weights win ----------------
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        random.seed(cfg.seed)
        factory = import_factory(cfg.model.factory)
        model = checks.build_model(factory, cfg.model.factory, cfg.model.kwargs)
        if pc.enabled:
            # Pure checks (identical on every rank) before the first message.
            pp.check_model(pc, model, world, cfg.model.factory)
        elif not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model.factory {cfg.model.factory!r} returned {type(model).__name__}, "
                              "expected a torch.nn.Module")
        else:
            checks.check_data_fits_model(cfg, model, factory, rank, world, comm.allgather_object)
        hvd.broadcast_parameters((model if isinstance(model, torch.nn.Module)
                                  else torch.nn.ModuleList(model)).state_dict(), root_rank=0)
        device = resolve_device(cfg.device)
        self.device = device
        pipe = None
        if pc.enabled:
            pipe = pc.build(model, sample_input=self._sample_input(pc, plan.batch_size),
                            device=None if device.type == "cpu" else device)
            data_rank, data_world = pipe.replica, pipe.layout.data_parallel
            model = pipe.module  # this rank's stage: what the optimizer steps
            if rank == 0:
                log.info("pipeline: %d stages x %d data-parallel replicas, %s schedule, %d micro-batches of a "
                         "%d-row replica batch; stage split %s", pipe.stages, data_world, pipe.schedule,
                         pipe.micro_batches, plan.batch_size, pipe.plan.describe())
        else:
            model.to(device)
        self.pipe = pipe
        # Per-rank streams from here on (dropout, augmentation differ per rank).
        torch.manual_seed(cfg.seed + 1_000_003 * (rank + 1))
        np.random.seed((cfg.seed + 7919 * (rank + 1)) % 2**32)
        random.seed(cfg.seed * 31 + rank)

        named = list(model.named_parameters())
        if pipe is not None and not any(p.requires_grad for _, p in named):
            # A stage without trainable parameters (only Flatten, pooling, activations, …).
            # torch optimizers refuse an empty list; a zero-size placeholder keeps one code path
            # (param_groups for the lr, state_dict for checkpoints) at no cost. It lives outside
            # the stage module, so checkpoints and the merged state_dict do not contain it.
            placeholder = torch.nn.Parameter(torch.zeros(0, device=device))
            named = [("pipeline.stage%d.placeholder" % pipe.stage, placeholder)]
            log.warning("pipeline stage %d (rank %d) holds no trainable parameters (layers %s)\n"
                        "HINT: set parallel.split_points to give every stage some work", pipe.stage, rank,
                        pipe.layer_names)
            inner = make_optimizer(cfg, [placeholder], plan.lr)
        else:
            inner = self._make_optimizer(model, plan.lr)
        strategy = cfg.sync.strategy
        if strategy == "parameter_server":
            strategy = f"parameter_server:{cfg.sync.server_rank}"
        elif strategy == "model_average":
            strategy = f"model_average:{cfg.sync.average_every}"
        if pipe is not None:
            from hpctrain.parallel import distributed_optimizer

            # Each stage's gradients are averaged over its data-parallel group; one backward
            # pass per micro-batch, k batches per step.
            opt = distributed_optimizer(
                pipe, inner, named_parameters=named, compression=getattr(hvd.Compression, cfg.sync.compression),
                backward_passes_per_step=cfg.sync.backward_passes_per_step * pipe.micro_batches,
                fusion_threshold=cfg.sync.fusion_threshold)
        else:
            opt = hvd.DistributedOptimizer(
                inner, named_parameters=model.named_parameters(),
                compression=getattr(hvd.Compression, cfg.sync.compression),
                backward_passes_per_step=cfg.sync.backward_passes_per_step, sync=strategy,
                backend=cfg.sync.backend, fusion_threshold=cfg.sync.fusion_threshold)
        timeline = Timeline(rank, enabled=cfg.timeline, max_steps=cfg.timeline_max_steps)
        if cfg.timeline and hasattr(opt, "_backend"):
            # Time each bucket's all-reduce (DistributedOptimizer takes backends by name only).
            opt._backend = TracingBackend(opt._backend, timeline)

        # -- checkpoints: pre-flight and resume ------------------------------------
        ckpt_dir = Path(cfg.checkpoint_dir)
        slots = {"sgd": 1 if cfg.optimizer.momentum > 0 else 0, "adam": 2, "adamw": 2}[cfg.optimizer.name]
        self._agree_or_raise(lambda: self._preflight(ckpt_dir, ckpt.estimate_bytes(model, slots, world)))
        state, resumed_from = self._find_resume(ckpt_dir)
        step, epoch, skip = 0, 0, 0
        weights: Optional[List[float]] = None
        if state is not None:
            if pipe is not None:
                pp.load(resumed_from, pipe, opt)
            else:
                checks.load_model_state(model, state["model"], resumed_from, state.get("config", {}).get("model"))
                opt.load_state_dict(state["optimizer"])
            step, epoch, skip = int(state["step"]), int(state["epoch"]), int(state["step_in_epoch"])
            extra = state.get("extra", {})
            weights = extra.get("balance_weights")
            if int(state["world_size"]) == world:
                ckpt.restore_rng(state["rng"][rank])
            else:
                log.warning("checkpoint was written by %d ranks, this run has %d: RNG streams restart from "
                            "the seed (the run is no longer bit-identical to an uninterrupted one)",
                            state["world_size"], world)
            if weights is not None and len(weights) != world:
                weights = None
            if rank == 0:
                log.info("resumed from %s (step %d, epoch %d)", resumed_from, step, epoch)
            del state
        if weights is not None:
            plan = make_plan(cfg, [plan.train_samples], [plan.test_samples], world, plan.batch_size, weights)

        def rank_batches() -> np.ndarray:
            """Samples per batch of every world rank (a pipeline's ranks share their replica's)."""
            return np.array([plan.rank_batch_sizes[r % data_world] for r in range(world)], float)

        # -- data ------------------------------------------------------------------
        # Every rank of one pipeline reads the same batches (rank=replica, world_size=DP), each
        # only the keys its stage needs; serial HDF5 (the stages read different keys).
        keys = [xk, yk] if pipe is None else pp.loader_keys(pipe.stage, pipe.stages, xk, yk)
        kdtypes = {k: v for k, v in dtypes.items() if k in keys}
        driver: Any = "auto" if pipe is None else None

        def train_set(w: Optional[List[float]]) -> HDF5Dataset:
            return HDF5Dataset(cfg.data.train, keys=keys, batch_size=plan.batch_size,
                               policy="weighted" if w is not None else cfg.data.policy, seed=cfg.seed,
                               shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last, weights=w,
                               rank=data_rank, world_size=data_world, dtypes=kdtypes, prefetch=cfg.data.prefetch,
                               driver=driver)

        ds = train_set(weights)
        test_ds = None
        if cfg.data.test:
            test_ds = HDF5Dataset(cfg.data.test, keys=keys,
                                  batch_size=eval_batch_size(cfg.eval.batch_size, plan.test_samples, data_world),
                                  shuffle=False, drop_last=False, rank=data_rank, world_size=data_world,
                                  dtypes=kdtypes, prefetch=cfg.data.prefetch, driver=driver)

        # -- outputs ---------------------------------------------------------------
        if rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            import yaml

            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            (self.run_dir / "plan.json").write_text(json.dumps(asdict(plan), indent=1))
        metrics = MetricsWriter(self.run_dir / "metrics.jsonl" if rank == 0 else None,
                                append=resumed_from is not None)
        tb = self._tensorboard() if rank == 0 else None
        if rank == 0:
            log.info("plan:\n%s", plan.describe())
            if resumed_from is not None:
                metrics.write({"kind": "event", "step": step, "what": "resume", "path": str(resumed_from)})

        guard = None
        if cfg.preemption and threading.current_thread() is threading.main_thread():
            from hpctrain.slurm import preempt

            guard = preempt.install()

        bar = None
        if rank == 0 and not cfg.quiet:
            from tqdm import tqdm

            bar = tqdm(total=plan.total_steps, initial=step, unit="step", dynamic_ncols=True, mininterval=0.5,
                       desc="train", file=sys.stderr)

        # -- the loop --------------------------------------------------------------
        detector = StragglerDetector(cfg.straggler_threshold, cfg.straggler_patience)
        eval_at = set(schedule_points(plan.total_steps, cfg.eval.interval_steps, plan.steps_per_epoch))
        ckpt_at = set(schedule_points(plan.total_steps, cfg.checkpoint.interval_steps, plan.steps_per_epoch))
        k = plan.accumulation
        dbg = cfg.debug
        prev_times = [0.0] * len(RANK_FIELDS)
        interval_rows: List[np.ndarray] = []
        epoch_busy = np.zeros(world)
        epoch_samples = np.zeros(world)
        last_loss: Optional[float] = None
        last_eval: Dict[str, Optional[float]] = {"test_accuracy": None, "test_loss": None}
        last_ckpt: Optional[str] = str(resumed_from) if resumed_from is not None else None
        status, message, sig, requeued = "completed", "", None, False
        wall_start = time.time()
        pending_record: Optional[Dict[str, Any]] = None
        comm.barrier()
        timeline.start_clock()
        t_train = time.perf_counter()
        (pipe if pipe is not None else model).train()

        def gather(row: np.ndarray) -> np.ndarray:
            # The per-step metrics gather runs right after synchronize() (nothing in flight) at
            # the same point of the same loop on every rank, so it skips comm's per-collective
            # agreement round trip (a second message exchange per step; the stall watchdog
            # still guards it). The gradient all-reduces keep their checks.
            was = comm.checks_enabled()
            comm.set_checks(False)
            try:
                return np.asarray(comm.allgather(row.reshape(1, -1))).reshape(world, -1)
            finally:
                comm.set_checks(was)

        def finish_record(rows: np.ndarray) -> None:
            nonlocal pending_record
            if pending_record is None:
                return
            times = rows[:, _G_TIMES:]
            rec = pending_record
            per = summarize_ranks(times.tolist())
            rec.update({name: float(times[0, j]) for j, name in enumerate(RANK_FIELDS)})
            rec["compute"] = rec["forward"] + rec["backward"]
            slowest = float(times[:, 0].max())
            rec["step_time_max"] = slowest
            rec["samples_per_s"] = rec["samples"] / slowest if slowest > 0 else 0.0
            rec.update(per)
            metrics.write(rec)
            if tb is not None:
                for key in ("loss", "lr", "samples_per_s", "step_time", "comm", "compute"):
                    tb.add_scalar("train/" + key, rec[key], rec["step"])
            pending_record = None

        try:
            while step < plan.total_steps and status == "completed":
                ds.set_epoch(epoch)
                # resume inside an epoch: the same order, minus what was done (without reading it)
                it = ds.iter_from(skip * k)
                s_in_epoch = skip
                skip = 0
                while s_in_epoch < plan.steps_per_epoch and step < plan.total_steps:
                    timeline.step = step
                    if dbg.fail_at_step == step and dbg.fail_rank == rank:
                        raise RuntimeError(f"debug.fail_at_step={step}: injected failure on rank {rank} "
                                           f"at unix time {time.time():.3f}")
                    t_step = time.perf_counter()
                    t_data = t_fwd = t_bwd = t_pipe_comm = 0.0
                    loss_sum = 0.0
                    n_real = 0.0
                    correct = 0.0
                    nonfinite = False
                    for _micro in range(k):
                        t0 = time.perf_counter()
                        batch = next(it)
                        t1 = time.perf_counter()
                        timeline.add("data-wait", t0, t1)
                        if dbg.slow_rank == rank and dbg.slow_ms > 0:
                            time.sleep(dbg.slow_ms / 1000.0)
                        if pipe is not None:
                            got = self._pipeline_batch(pipe, batch, xk, yk, plan, data_world,
                                                       dbg.nan_at_step == step and dbg.nan_rank == rank)
                            t2 = time.perf_counter()
                            timeline.add("pipeline", t1, t2)
                            t_data += t1 - t0
                            t_fwd += pipe.last_stats.compute_seconds  # forward + backward of the stage
                            t_pipe_comm += pipe.last_stats.comm_seconds
                            loss_sum += got[0]
                            n_real += got[1]
                            correct += got[2]
                            nonfinite = nonfinite or not np.isfinite(got[0])
                            continue
                        x, y, mask = (batch[xk].to(device, non_blocking=True), batch[yk].to(device, non_blocking=True),
                                      batch["mask"].to(device, non_blocking=True))
                        out = model(x)
                        per_sample = self._per_sample_loss(out, y)
                        m = mask.to(per_sample.dtype)
                        local_sum = (per_sample * m).sum()
                        if dbg.nan_at_step == step and dbg.nan_rank == rank:
                            local_sum = local_sum * float("nan")
                        # Average over the global batch: the all-reduce averages over ranks,
                        # so scale by world / global batch (exact with unequal per-rank batches).
                        loss = local_sum * (world / plan.global_batch)
                        t2 = time.perf_counter()
                        timeline.add("forward", t1, t2)
                        loss.backward()
                        t3 = time.perf_counter()
                        timeline.add("backward", t2, t3)
                        t_data += t1 - t0
                        t_fwd += t2 - t1
                        t_bwd += t3 - t2
                        ls = float(local_sum.detach())
                        nonfinite = nonfinite or not np.isfinite(ls)
                        loss_sum += ls
                        n_real += float(m.sum())
                        if cfg.loss == "cross_entropy":
                            correct += float(((out.detach().argmax(1) == y) & mask).sum())
                    t4 = time.perf_counter()
                    opt.synchronize()  # waits for the gradient buckets (no-op for model_average)
                    # Stop flag = the signal number this rank received (0: none); any rank -> all stop.
                    stop_sig = float(int(guard.received)) if guard is not None and guard.received else 0.0
                    row = np.array([loss_sum, n_real, float(nonfinite), stop_sig, correct, *prev_times])
                    rows = gather(row)
                    t5 = time.perf_counter()
                    timeline.add("comm-wait", t4, t5)
                    finish_record(rows)  # the previous step's record now has every rank's timings
                    interval_rows.append(rows[:, _G_TIMES:])
                    if rows[:, _G_NONFINITE].any():
                        bad = [int(r) for r in np.flatnonzero(rows[:, _G_NONFINITE])]
                        where = f"step {step} (epoch {epoch})"
                        if cfg.on_nan == "skip":
                            opt.zero_grad()
                            if rank == 0:
                                log.warning("non-finite loss at %s on rank(s) %s: step skipped (on_nan: skip)",
                                            where, bad)
                            metrics.write({"kind": "event", "step": step, "what": "nan_skip", "ranks": bad})
                        else:
                            status = "nan"
                            message = (
                                f"loss is NaN/Inf at {where} on rank(s) {bad}; training stopped before "
                                f"applying that step. Last good checkpoint: {last_ckpt or 'none written yet'}.\n"
                                "HINT: lower optimizer.lr or add schedule.warmup_steps, check the data "
                                "(hpctrain data verify), or set on_nan: skip to skip such steps")
                            metrics.write({"kind": "event", "step": step, "what": "nan_stop", "ranks": bad})
                            break
                    else:
                        lr_now = plan.lr * lr_factor(step, plan.total_steps, cfg.schedule)
                        for g in opt.param_groups:
                            g["lr"] = lr_now
                        t6 = time.perf_counter()
                        with opt.skip_synchronize():
                            opt.step()
                        opt.zero_grad()
                        t7 = time.perf_counter()
                        timeline.add("optimizer", t6, t7)
                    t_end = time.perf_counter()
                    comm_s = t5 - t4 + t_pipe_comm
                    prev_times = [t_end - t_step, t_data, t_fwd, t_bwd, comm_s, t_end - t5, rss_mb()]
                    total_real = float(rows[:, _G_REAL].sum())
                    last_loss = float(rows[:, _G_LOSS].sum() / total_real) if total_real else float("nan")
                    pending_record = {
                        "kind": "train", "step": step + 1, "epoch": epoch, "loss": last_loss,
                        "train_accuracy": (float(rows[:, _G_CORRECT].sum() / total_real)
                                           if total_real and cfg.loss == "cross_entropy" else None),
                        "lr": float(opt.param_groups[0]["lr"]), "samples": total_real,
                        "time": time.time() - wall_start,
                    }
                    step += 1
                    s_in_epoch += 1
                    if bar is not None:
                        bar.update(1)
                        if step % cfg.log_interval == 0 or step == plan.total_steps:
                            bar.set_postfix(loss=f"{last_loss:.4f}", samples_s=f"{self._last_rate(rows):.0f}",
                                            epoch=epoch, refresh=False)
                    # Per-interval straggler check on the gathered (previous-step) timings.
                    if len(interval_rows) >= cfg.log_interval:
                        t = np.stack(interval_rows)  # (steps, world, fields)
                        busy_r = (t[:, :, 0] - t[:, :, 4]).mean(axis=0)
                        epoch_busy += (t[:, :, 0] - t[:, :, 4]).sum(axis=0)
                        epoch_samples += len(interval_rows) * rank_batches() * k
                        for rep in detector.update(busy_r.tolist()):
                            if rank == 0:
                                log.warning(
                                    "straggler: rank %d is %.0f%% slower than the median (%.1f ms vs %.1f ms "
                                    "busy per step) for %d intervals%s", rep["rank"], 100 * rep["slower_by"],
                                    1e3 * rep["busy"], 1e3 * rep["median"], cfg.straggler_patience,
                                    "" if cfg.balance == "auto" else
                                    "; HINT: balance the stages with parallel.split_points (or balance: time)"
                                    if pipe is not None else "; HINT: balance: auto re-weights the data")
                            metrics.write({"kind": "event", "step": step, "what": "straggler", **rep})
                        interval_rows = []
                    stop_now = bool(rows[:, _G_STOP].any())
                    debug_stop = dbg.stop_at_step >= 0 and step >= dbg.stop_at_step
                    epoch_end = s_in_epoch >= plan.steps_per_epoch
                    pos = (epoch + 1, 0) if epoch_end else (epoch, s_in_epoch)
                    if step in eval_at and test_ds is not None:
                        last_eval = (self._evaluate(model, test_ds, timeline, xk, yk) if pipe is None
                                     else self._evaluate_pipeline(pipe, test_ds, timeline, xk, yk))
                        rec = {"kind": "eval", "step": step, "epoch": epoch, **last_eval}
                        metrics.write(rec)
                        if tb is not None:
                            for key, v in last_eval.items():
                                if v is not None:
                                    tb.add_scalar("eval/" + key, v, step)
                        if rank == 0:
                            acc = last_eval.get("test_accuracy")
                            msg = (f"step {step}/{plan.total_steps} epoch {epoch}: loss {last_loss:.4f}, "
                                   f"test loss {last_eval.get('test_loss') or float('nan'):.4f}"
                                   + (f", test accuracy {acc:.4f}" if acc is not None else ""))
                            (bar.write(msg) if bar is not None else log.info(msg))
                    if cfg.checkpoint.enabled and (step in ckpt_at or stop_now or debug_stop):
                        last_ckpt = (self._save(ckpt_dir, model, opt, step, pos, weights, timeline) if pipe is None
                                     else self._save_pipeline(ckpt_dir, pipe, opt, step, pos, timeline))
                    if stop_now or debug_stop:
                        if stop_now:
                            status = "preempted"
                            sig = int(rows[:, _G_STOP].max())
                            message = (f"stop signal received: checkpoint {last_ckpt} written at step {step}; "
                                       "rerun with --resume auto to continue")
                        else:
                            status = "stopped"
                            message = f"debug.stop_at_step={dbg.stop_at_step}: stopped at step {step}"
                        break
                if status != "completed":
                    break
                if s_in_epoch >= plan.steps_per_epoch:
                    # Epoch boundary: re-balance the partition from measured throughput.
                    if cfg.balance == "auto" and world > 1 and epoch_busy.sum() > 0:
                        rates = (epoch_samples / np.maximum(epoch_busy, 1e-9)).tolist()
                        new = rebalance_weights(rates, weights)
                        if new is not None:
                            weights = new
                            plan = make_plan(cfg, [plan.train_samples], [plan.test_samples], world,
                                             plan.batch_size, weights)
                            ds.close()
                            ds = train_set(weights)
                            if rank == 0:
                                log.info("balance: new data shares per rank %s (batch sizes %s) from measured "
                                         "samples/s %s", weights, list(plan.rank_batch_sizes),
                                         [round(r) for r in rates])
                            metrics.write({"kind": "event", "step": step, "what": "rebalance", "weights": weights,
                                           "batch_sizes": list(plan.rank_batch_sizes)})
                    epoch_busy[:] = 0
                    epoch_samples[:] = 0
                    epoch += 1
            # The last step's timings: one more gather (every rank reaches here together).
            rows = gather(np.array([0.0, 0.0, 0.0, 0.0, 0.0, *prev_times]))
            finish_record(rows)
        finally:
            if bar is not None:
                bar.close()
            if guard is not None:
                guard.uninstall()
            ds.close()
            if test_ds is not None:
                test_ds.close()

        if status == "preempted" and rank == 0:
            requeued = guard.requeue(rank=rank) if guard is not None else False
        wall = time.perf_counter() - t_begin
        self._write_timeline(timeline)
        result = FitResult(status=status, step=step, epoch=epoch, run_dir=str(self.run_dir), checkpoint=last_ckpt,
                           final_loss=last_loss, test_accuracy=last_eval.get("test_accuracy"),
                           test_loss=last_eval.get("test_loss"), wall_s=wall, message=message, signal=sig,
                           requeued=requeued)
        if rank == 0:
            metrics.write({"kind": "event", "step": step, "what": status, "message": message})
            summary = {"result": asdict(result), "plan": asdict(plan), "world_size": world,
                       "train_seconds": time.perf_counter() - t_train, "hpctrain_version": hpctrain.__version__,
                       "config": cfg.to_dict()}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        metrics.close()
        if tb is not None:
            tb.close()
        if status == "nan" and rank == 0:
            log.error("%s", message)
        return result

    # ------------------------------------------------------------------ pieces
    def _make_optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        return make_optimizer(self.cfg, model.parameters(), lr)

    def _per_sample_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return per_sample_loss(self.cfg, out, y)

    @staticmethod
    def _last_rate(rows: np.ndarray) -> float:
        slowest = float(rows[:, _G_TIMES].max())
        return float(rows[:, _G_REAL].sum()) / slowest if slowest > 0 else 0.0

    def _agree_or_raise(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on rank 0; every rank raises the same error if it failed (no rank hangs)."""
        problem = None
        if self.rank == 0:
            try:
                fn()
            except (ckpt.CheckpointError, ConfigError) as exc:
                problem = (type(exc).__name__, str(exc))
        problem = comm.broadcast_object(problem, root=0)
        if problem is not None:
            cls = ckpt.CheckpointError if problem[0] == "CheckpointError" else ConfigError
            raise cls(problem[1])

    def _preflight(self, ckpt_dir: Path, estimate: int) -> None:
        if self.cfg.checkpoint.enabled:
            ckpt.preflight(ckpt_dir, estimate, self.cfg.checkpoint.keep)
            found = ckpt.list_checkpoints(ckpt_dir) + pp.list_checkpoints(ckpt_dir)
            if self.resume is None and found:
                newest = max(found)[1]
                raise ckpt.CheckpointError(
                    f"checkpoint directory {str(ckpt_dir)!r} already holds checkpoints of an earlier run "
                    f"(newest: {newest.name}); starting fresh would mix the two runs\n"
                    "HINT: pass --resume auto to continue that run, or set run_dir (or checkpoint.dir) "
                    "to a new directory")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"run_dir {str(self.run_dir)!r} cannot be created: {exc}") from exc

    def _find_resume(self, ckpt_dir: Path) -> Tuple[Optional[Dict[str, Any]], Optional[Path]]:
        """Rank 0 picks the checkpoint (and checks it loads); every rank then loads that file."""
        if self.resume is None:
            return None, None
        choice: Any = None
        pipeline = self.pipe is not None
        if self.rank == 0:
            try:
                if self.resume == "auto" and pipeline:
                    found = pp.newest_valid(ckpt_dir)
                    if found is None and ckpt.list_checkpoints(ckpt_dir):
                        raise ckpt.CheckpointError(
                            f"{ckpt_dir} holds data-parallel checkpoints (ckpt-*.pt) but this run has a pipeline "
                            "(parallel.pipeline_stages > 1), which resumes from pipeline-<step>/ directories.\n"
                            "HINT: resume with the same parallel: settings as the run that wrote them, or use a "
                            "new checkpoint.dir")
                    choice = ("ok", str(found[0])) if found else ("none", None)
                elif self.resume == "auto":
                    found = ckpt.newest_valid(ckpt_dir)
                    if found is None and pp.list_checkpoints(ckpt_dir):
                        raise ckpt.CheckpointError(
                            f"{ckpt_dir} holds pipeline checkpoints (pipeline-<step>/) but this run has no "
                            "parallel: section.\nHINT: resume with the parallel: settings of the run that wrote "
                            "them, or merge one (python -m hpctrain.parallel.checkpoint merge DIR -o model.pt)")
                    choice = ("ok", str(found[0])) if found else ("none", None)
                elif pipeline:
                    pp.load_meta(Path(self.resume))
                    choice = ("ok", str(self.resume))
                else:
                    ckpt.load_checkpoint(Path(self.resume))
                    choice = ("ok", str(self.resume))
            except ckpt.CheckpointError as exc:
                choice = ("error", str(exc))
        choice = comm.broadcast_object(choice, root=0)
        if choice[0] == "error":
            raise ckpt.CheckpointError(choice[1])
        if choice[0] == "none":
            if self.rank == 0:
                log.info("--resume auto: no checkpoint in %s; starting from scratch", ckpt_dir)
            return None, None
        path = Path(choice[1])
        return (pp.load_meta(path) if pipeline else ckpt.load_checkpoint(path)), path

    def _save(self, ckpt_dir: Path, model: torch.nn.Module, opt: Any, step: int, pos: Tuple[int, int],
              weights: Optional[List[float]], timeline: Timeline) -> Optional[str]:
        t0 = time.perf_counter()
        rngs = comm.allgather_object(ckpt.capture_rng())
        result: Any = None
        if self.rank == 0:
            state = ckpt.build_state(step=step, epoch=pos[0], step_in_epoch=pos[1], model=model, optimizer=opt,
                                     scheduler={"kind": self.cfg.schedule.kind, "step": step},
                                     rng=rngs, config=self.cfg.to_dict(),
                                     extra={"balance_weights": weights, "scheduler_step": step})
            try:
                saved = ckpt.save(ckpt_dir, state, self.cfg.checkpoint.keep)
                result = ("ok", str(saved.path))
            except ckpt.CheckpointError as exc:
                result = ("error", str(exc))
        result = comm.broadcast_object(result, root=0)
        timeline.add("checkpoint", t0, time.perf_counter())
        if result[0] == "error":
            raise ckpt.CheckpointError(result[1])
        return result[1]

    # ------------------------------------------------------------------ pipeline mode
    def _sample_input(self, pc: Any, batch_size: int) -> Optional[torch.Tensor]:
        """One micro-batch of zeros shaped like the data, for ``parallel.balance: time``."""
        if pc.balance != "time" or pc.split_points is not None or pc.sizes is not None:
            return None
        from hpctrain.data.h5files import describe, expand_paths
        from hpctrain.data.loader import _torch_dtype

        xk = self.cfg.data.keys["x"]
        info = describe(expand_paths(list(self.cfg.data.train))[0], [xk])
        dtype = _torch_dtype(self.cfg.data.dtypes.get("x", "float32")) or torch.float32
        return torch.zeros((max(1, batch_size // pc.micro_batches), *info.keys[xk].shape[1:])).to(dtype)

    def _pipeline_batch(self, pipe: Any, batch: Dict[str, torch.Tensor], xk: str, yk: str, plan: TrainPlan,
                        data_world: int, inject_nan: bool) -> Tuple[float, float, float]:
        """One batch through the pipeline: (loss sum, real samples, correct) of this rank —
        numbers only on the last stage (zeros elsewhere, so the per-step gather sums them once)."""
        cfg = self.cfg
        sums = [0.0, 0.0, 0.0]
        # Masked sum over the replica's batch scaled by DP / global batch: after the
        # data-parallel average the gradient is that of the global batch-mean loss — the same
        # normalisation as the data-parallel loop (world -> replicas).
        scale = data_world / plan.global_batch

        def loss_fn(out: torch.Tensor, t: pp.Targets) -> torch.Tensor:
            per = per_sample_loss(cfg, out, t.y)
            m = t.mask.to(per.dtype)
            local = (per * m).sum()
            if inject_nan:
                local = local * float("nan")
            sums[0] += float(local.detach())
            sums[1] += float(m.sum())
            if cfg.loss == "cross_entropy":
                sums[2] += float(((out.detach().argmax(1) == t.y) & t.mask).sum())
            return local * scale

        x = batch[xk] if pipe.is_first else None
        targets = pp.Targets(batch[yk], batch["mask"]) if pipe.is_last else pp.Targets(batch["mask"], batch["mask"])
        pipe.train_step(x, targets, loss_fn, rows_weighted=False)
        return sums[0], sums[1], sums[2]

    def _evaluate_pipeline(self, pipe: Any, test_ds: Any, timeline: Timeline, xk: str, yk: str
                           ) -> Dict[str, Optional[float]]:
        """:meth:`_evaluate` through the pipeline: sums on the last stages, all-reduced."""
        t0 = time.perf_counter()
        cfg = self.cfg
        pipe.eval()
        sums = np.zeros(3, dtype=np.float64)  # loss sum, correct, count

        def loss_fn(out: torch.Tensor, t: pp.Targets) -> torch.Tensor:
            per = per_sample_loss(cfg, out, t.y)
            m = t.mask.to(per.dtype)
            sums[0] += float((per.double() * m.double()).sum())
            if cfg.loss == "cross_entropy":
                sums[1] += float(((out.argmax(1) == t.y) & t.mask).sum())
            sums[2] += float(m.sum())
            return per.sum()

        for batch in test_ds:
            x = batch[xk] if pipe.is_first else None
            mask = batch["mask"]
            targets = pp.Targets(batch[yk], mask) if pipe.is_last else pp.Targets(mask, mask)
            pipe.evaluate(x, targets, loss_fn, rows_weighted=False,
                          micro_batches=max(1, min(pipe.micro_batches, len(mask))))
        pipe.train()
        total = comm.allreduce(sums, op="sum")
        timeline.add("eval", t0, time.perf_counter())
        n = float(total[2])
        res: Dict[str, Optional[float]] = {"test_samples": n}
        res["test_loss"] = float(total[0] / n) if n and "loss" in cfg.eval.metrics else None
        res["test_accuracy"] = (float(total[1] / n) if n and "accuracy" in cfg.eval.metrics
                                and cfg.loss == "cross_entropy" else None)
        return res

    def _save_pipeline(self, ckpt_dir: Path, pipe: Any, opt: Any, step: int, pos: Tuple[int, int],
                       timeline: Timeline) -> Optional[str]:
        t0 = time.perf_counter()
        meta = pp.build_meta(step=step, epoch=pos[0], step_in_epoch=pos[1], pipe=pipe, config=self.cfg.to_dict(),
                             extra={"balance_weights": None, "scheduler_step": step})
        path = pp.save(ckpt_dir, pipe, opt, meta, self.cfg.checkpoint.keep)
        timeline.add("checkpoint", t0, time.perf_counter())
        return path

    def _evaluate(self, model: torch.nn.Module, test_ds: Any, timeline: Timeline, xk: str, yk: str
                  ) -> Dict[str, Optional[float]]:
        """Exact metrics over the whole test set: padding ignored, sums all-reduced."""
        t0 = time.perf_counter()
        model.eval()
        sums = np.zeros(3, dtype=np.float64)  # loss sum, correct, count
        with torch.no_grad():
            dev = self.device
            for batch in test_ds:
                out = model(batch[xk].to(dev, non_blocking=True))
                y, mask = batch[yk].to(dev, non_blocking=True), batch["mask"].to(dev, non_blocking=True)
                per = self._per_sample_loss(out, y)
                sums[0] += float((per.double() * mask.double()).sum())
                if self.cfg.loss == "cross_entropy":
                    sums[1] += float(((out.argmax(1) == y) & mask).sum())
                sums[2] += float(mask.sum())
        model.train()
        total = comm.allreduce(sums, op="sum")
        timeline.add("eval", t0, time.perf_counter())
        n = float(total[2])
        res: Dict[str, Optional[float]] = {"test_samples": n}
        res["test_loss"] = float(total[0] / n) if n and "loss" in self.cfg.eval.metrics else None
        res["test_accuracy"] = (float(total[1] / n) if n and "accuracy" in self.cfg.eval.metrics
                                and self.cfg.loss == "cross_entropy" else None)
        return res

    def _write_timeline(self, timeline: Timeline) -> None:
        if not self.cfg.timeline:
            return
        tag = 9123
        if self.rank == 0:
            per_rank = [timeline.events]
            for r in range(1, self.world):
                per_rank.append(comm.recv_object(source=r, tag=tag))
            write_trace(self.run_dir / "timeline.json", chrome_trace(per_rank))
        else:
            comm.send_object(timeline.events, dest=0, tag=tag)

    def _tensorboard(self) -> Any:
        if not self.cfg.tensorboard:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("tensorboard: true needs the tensorboard package\n"
                              "HINT: pip install tensorboard, or set tensorboard: false") from exc
        return SummaryWriter(str(self.run_dir / "tensorboard"))
