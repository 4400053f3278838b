"""Building a run: everything :meth:`Trainer.fit` needs before its first step.

In order, on every rank: the process (threads, determinism), the model (same seed
everywhere, rank 0's weights broadcast; split into stages with a ``parallel:`` section), the
optimizer, the checkpoint pre-flight and resume, the data, and the outputs. The result is one
:class:`Run`; the loop (:mod:`hpctrain.train.loop`) only walks it.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hpctrain import comm
from hpctrain.train import checkpoint as ckpt
from hpctrain.train import pipeline as pp
from hpctrain.train.config import ConfigError, TrainConfig
from hpctrain.train.metrics import MetricsWriter
from hpctrain.train.plan import TrainPlan, eval_batch_size, make_plan
from hpctrain.train.timeline import Timeline, TracingBackend

log = logging.getLogger("hpctrain.train")


# ---------------------------------------------------------------------------- components
def import_factory(spec: str, what: str = "model.factory") -> Callable[..., Any]:
    """``"pkg.module:fn"`` or ``"path/to/file.py:fn"`` -> the callable (``what`` names the
    config key in errors)."""
    mod_name, _, fn_name = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise ConfigError(f"{what}: file {mod_name!r} does not exist\nHINT: paths in a config are "
                                  "relative to the config file's folder")
            unique = "hpctrain_user_model_" + str(abs(hash(str(path.resolve()))))
            mod_spec = importlib.util.spec_from_file_location(unique, path)
            module = importlib.util.module_from_spec(mod_spec)  # type: ignore[arg-type]
            sys.modules[unique] = module
            mod_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{what}: cannot import {mod_name!r} ({exc})\n"
                          "HINT: use an importable module (pip install -e your package) or a file path "
                          "like 'examples/models.py:cnn'") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        from hpctrain.train.checks import callable_hint

        raise ConfigError(f"{what}: {mod_name!r} has no callable {fn_name!r}" + callable_hint(module, fn_name))
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
    from hpctrain.train.losses import build_loss, parse_loss

    return build_loss(parse_loss(cfg.loss), importer=lambda spec: import_factory(spec, "loss"))(out, y)


#: built-in factories whose input width and class count the runner fills in from the data
BUILTIN_MODELS = {"hpctrain.train.models:mlp": ("in_features", "num_classes"),
                  "hpctrain.train.models:cnn": (None, "num_classes")}


def infer_model_kwargs(cfg: TrainConfig) -> Dict[str, Any]:
    """``model.kwargs`` with the built-in models' ``in_features`` / ``num_classes`` taken from
    the training data when not given (the same on every rank: HDF5 metadata and labels)."""
    kwargs = dict(cfg.model.kwargs)
    wanted = BUILTIN_MODELS.get(cfg.model.factory)
    if wanted is None:
        return kwargs
    from hpctrain.data.h5files import describe, expand_paths
    from hpctrain.data.labels import label_summary
    from hpctrain.train.losses import parse_loss

    features, classes = wanted
    if features and features not in kwargs:
        xk = cfg.data.x_key
        shape = describe(expand_paths(list(cfg.data.train))[0], [xk]).keys[xk].shape[1:]
        kwargs[features] = int(np.prod(shape, dtype=np.int64))
    spec = parse_loss(cfg.loss)
    if classes not in kwargs and spec.classification is not False:
        labels = label_summary(expand_paths(list(cfg.data.train)), cfg.data.keys["y"])
        if labels.count and not labels.fractional and labels.low is not None and labels.low >= 0:
            kwargs[classes] = int(labels.high) + 1
    return kwargs


def import_user_functions(cfg: TrainConfig) -> None:
    """Import every user file a config names besides the model (loss, metrics), so that a
    dry run fails where the run would."""
    from hpctrain.train.losses import parse_loss
    from hpctrain.train.scoring import parse_metrics

    spec = parse_loss(cfg.loss)
    if spec.function:
        import_factory(spec.function, "loss")
    for m in parse_metrics(cfg.eval.metrics, None):
        if m.kind == "user":
            import_factory(m.function, "eval.metrics")


def resolve_batch_size(cfg: TrainConfig, max_batch: int) -> int:
    """``batch_size`` as an int; ``"auto"`` runs hpctrain.probe's tuner (collective: every rank
    calls it): the largest per-rank batch whose training step fits in memory on every rank,
    capped at ``max_batch`` (the samples each rank has)."""
    if cfg.batch_size != "auto":
        return int(cfg.batch_size)
    from hpctrain.data.h5files import describe, expand_paths
    from hpctrain.data.loader import _torch_dtype
    from hpctrain.probe import tune_batch_size

    xk, yk = cfg.data.x_key, cfg.data.keys["y"]
    info = describe(expand_paths(list(cfg.data.train))[0], [xk, yk])
    xshape, yshape = info.keys[xk].shape[1:], info.keys[yk].shape[1:]
    xdt = _torch_dtype(cfg.data.dtypes.get("x", "float32")) or torch.float32
    factory = import_factory(cfg.model.factory)
    kwargs = infer_model_kwargs(cfg)
    from hpctrain.train.losses import parse_loss

    classify = parse_loss(cfg.loss).classification is not False

    def make_batch(b: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand((b, *xshape)).to(xdt)
        y = torch.zeros((b,), dtype=torch.long) if classify else torch.zeros((b, *yshape))
        return x, y

    res = tune_batch_size(lambda: factory(**kwargs), make_batch,
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


def auto_threads(cfg: TrainConfig) -> None:
    """``threads`` (0: the node's cores shared among its ranks, unless OMP_NUM_THREADS is set)."""
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
        return
    if os.environ.get("OMP_NUM_THREADS"):
        return
    per_node = max(1, comm.local_size())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or cores) // per_node))


def seed_shared(seed: int) -> None:
    """The same streams on every rank (model initialisation)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def seed_per_rank(seed: int, rank: int) -> None:
    """Per-rank streams from here on (dropout, augmentation differ per rank)."""
    torch.manual_seed(seed + 1_000_003 * (rank + 1))
    np.random.seed((seed + 7919 * (rank + 1)) % 2**32)
    random.seed(seed * 31 + rank)


# ---------------------------------------------------------------------------- the run
@dataclass
class Run:
    """A built run: what the loop walks. ``step_impl`` is a :mod:`hpctrain.train.steps` object
    (data-parallel or pipeline); ``model`` is what the optimizer steps (a pipeline rank's stage)."""

    cfg: TrainConfig
    rank: int
    world: int
    plan: TrainPlan
    model: torch.nn.Module
    opt: Any
    step_impl: Any
    timeline: Timeline
    run_dir: Path
    ckpt_dir: Path
    data_rank: int
    data_world: int
    step: int = 0
    epoch: int = 0
    skip: int = 0
    weights: Optional[List[float]] = None
    resumed_from: Optional[Path] = None
    ds: Any = None
    test_ds: Any = None
    metrics: Any = None
    tb: Any = None
    guard: Any = None
    keys: List[str] = field(default_factory=list)

    @property
    def pipe(self) -> Any:
        return getattr(self.step_impl, "pipe", None)

    def train_set(self, weights: Optional[List[float]]) -> Any:
        """The training loader for this rank's share (``weights``: per data rank, or None)."""
        from hpctrain.data import HDF5Dataset

        cfg = self.cfg
        return HDF5Dataset(cfg.data.train, keys=self.keys, batch_size=self.plan.batch_size,
                           policy="weighted" if weights is not None else cfg.data.policy, seed=cfg.seed,
                           shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last, weights=weights,
                           stratify=(cfg.data.stratify or cfg.data.keys["y"]) if cfg.data.policy == "stratified"
                           else None, rank=self.data_rank, world_size=self.data_world, dtypes=self._dtypes(),
                           prefetch=cfg.data.prefetch, driver=self._driver())

    def rank_batches(self) -> np.ndarray:
        """Samples per batch of every world rank (a pipeline's ranks share their replica's)."""
        return np.array([self.plan.rank_batch_sizes[r % self.data_world] for r in range(self.world)], float)

    def close(self) -> None:
        """Release the preemption handler and the loaders (also after an error)."""
        if self.guard is not None:
            self.guard.uninstall()
        if self.ds is not None:
            self.ds.close()
        if self.test_ds is not None:
            self.test_ds.close()

    def _dtypes(self) -> Dict[str, str]:
        data = self.cfg.data
        names = {"x": data.x_keys, "y": [data.keys["y"]]}
        dtypes = {k: dt for role, dt in data.dtypes.items() for k in names[role]}
        return {k: v for k, v in dtypes.items() if k in self.keys}

    def _driver(self) -> Any:
        # Every rank of one pipeline reads the same batches (rank=replica, world_size=DP), each
        # only the keys its stage needs: serial HDF5 (the stages read different keys).
        return "auto" if self.pipe is None else None


def init_process(cfg: TrainConfig) -> Tuple[int, int]:
    """Initialise hpctrain.torch, threads and determinism; returns (rank, world)."""
    import hpctrain.torch as hvd

    hvd.init()
    auto_threads(cfg)
    if cfg.deterministic:
        # cuDNN autotuning picks kernels by timing: off for reproducible runs. (CPU kernels
        # are deterministic for a fixed thread count.)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    return comm.rank(), comm.size()


def build_model(cfg: TrainConfig, plan: TrainPlan, world: int) -> Tuple[Any, torch.device]:
    """The model on every rank with rank 0's weights, on this rank's device; with a pipeline,
    the model is returned whole (:func:`build_step` splits it)."""
    import hpctrain.torch as hvd

    pc = pp.parallel_config(cfg)
    seed_shared(cfg.seed)
    from hpctrain.train import checks

    factory = import_factory(cfg.model.factory)
    model = checks.build_model(factory, cfg.model.factory, infer_model_kwargs(cfg))
    if pc.enabled:
        # Pure checks (identical on every rank) before the first message.
        pp.check_model(pc, model, world, cfg.model.factory)
    elif not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model.factory {cfg.model.factory!r} returned {type(model).__name__}, "
                          "expected a torch.nn.Module")
    else:
        # collective: every rank reads its part of the labels; all raise the same error or none
        checks.check_data_fits_model(cfg, model, factory, comm.rank(), world, comm.allgather_object)
    hvd.broadcast_parameters((model if isinstance(model, torch.nn.Module)
                              else torch.nn.ModuleList(model)).state_dict(), root_rank=0)
    return model, resolve_device(cfg.device)


def sync_name(cfg: TrainConfig) -> str:
    """The ``sync=`` of DistributedOptimizer for ``cfg.sync`` (not for ``model_average``: the
    runner merges itself, :mod:`hpctrain.train.averaging`)."""
    if cfg.sync.strategy == "parameter_server":
        return f"parameter_server:{cfg.sync.server_rank}"
    return cfg.sync.strategy


def attach_timeline(cfg: TrainConfig, opt: Any, rank: int) -> Timeline:
    """The per-rank timeline; with it on, every bucket's all-reduce is timed too."""
    timeline = Timeline(rank, enabled=cfg.timeline, max_steps=cfg.timeline_max_steps)
    if cfg.timeline and hasattr(opt, "_backend"):
        # DistributedOptimizer takes backends by name only: wrap the one it built.
        opt._backend = TracingBackend(opt._backend, timeline)
    return timeline


# ---------------------------------------------------------------------------- checkpoints
def agree_or_raise(fn: Callable[[], None], rank: int) -> None:
    """Run ``fn`` on rank 0; every rank raises the same error if it failed (no rank hangs)."""
    problem = None
    if rank == 0:
        try:
            fn()
        except (ckpt.CheckpointError, ConfigError) as exc:
            problem = (type(exc).__name__, str(exc))
    problem = comm.broadcast_object(problem, root=0)
    if problem is not None:
        cls = ckpt.CheckpointError if problem[0] == "CheckpointError" else ConfigError
        raise cls(problem[1])


def preflight(cfg: TrainConfig, ckpt_dir: Path, estimate: int, resume: Optional[str], run_dir: Path) -> None:
    """Rank 0: room for the checkpoints, no earlier run's checkpoints on a fresh start, and a
    run directory that can be created."""
    if cfg.checkpoint.enabled:
        ckpt.preflight(ckpt_dir, estimate, cfg.checkpoint.keep)
        found = ckpt.list_checkpoints(ckpt_dir) + pp.list_checkpoints(ckpt_dir)
        if resume is None and found:
            newest = max(found)[1]
            raise ckpt.CheckpointError(
                f"checkpoint directory {str(ckpt_dir)!r} already holds checkpoints of an earlier run "
                f"(newest: {newest.name}); starting fresh would mix the two runs\n"
                "HINT: pass --resume auto to continue that run, or set run_dir (or checkpoint.dir) "
                "to a new directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run_dir {str(run_dir)!r} cannot be created: {exc}") from exc


def _pick_resume(resume: str, ckpt_dir: Path, pipeline: bool) -> Tuple[str, Optional[str]]:
    """Rank 0's choice: ("ok", path) or ("none", None); CheckpointError when it cannot be used."""
    if resume == "auto" and pipeline:
        found = pp.newest_valid(ckpt_dir)
        if found is None and ckpt.list_checkpoints(ckpt_dir):
            raise ckpt.CheckpointError(
                f"{ckpt_dir} holds data-parallel checkpoints (ckpt-*.pt) but this run has a pipeline "
                "(parallel.pipeline_stages > 1), which resumes from pipeline-<step>/ directories.\n"
                "HINT: resume with the same parallel: settings as the run that wrote them, or use a "
                "new checkpoint.dir")
        return ("ok", str(found[0])) if found else ("none", None)
    if resume == "auto":
        found = ckpt.newest_valid(ckpt_dir)
        if found is None and pp.list_checkpoints(ckpt_dir):
            raise ckpt.CheckpointError(
                f"{ckpt_dir} holds pipeline checkpoints (pipeline-<step>/) but this run has no "
                "parallel: section.\nHINT: resume with the parallel: settings of the run that wrote "
                "them, or merge one (python -m hpctrain.parallel.checkpoint merge DIR -o model.pt)")
        return ("ok", str(found[0])) if found else ("none", None)
    if pipeline:
        pp.load_meta(Path(resume))
    else:
        ckpt.load_checkpoint(Path(resume))
    return ("ok", str(resume))


def find_resume(resume: Optional[str], ckpt_dir: Path, pipeline: bool, rank: int
                ) -> Tuple[Optional[Dict[str, Any]], Optional[Path]]:
    """Rank 0 picks the checkpoint (and checks it loads); every rank then loads that file."""
    if resume is None:
        return None, None
    choice: Any = None
    if rank == 0:
        try:
            choice = _pick_resume(resume, ckpt_dir, pipeline)
        except ckpt.CheckpointError as exc:
            choice = ("error", str(exc))
    choice = comm.broadcast_object(choice, root=0)
    if choice[0] == "error":
        raise ckpt.CheckpointError(choice[1])
    if choice[0] == "none":
        if rank == 0:
            log.info("--resume auto: no checkpoint in %s; starting from scratch", ckpt_dir)
        return None, None
    path = Path(choice[1])
    return (pp.load_meta(path) if pipeline else ckpt.load_checkpoint(path)), path


def restore(run: Run, state: Dict[str, Any], path: Path) -> None:
    """Continue from a loaded checkpoint: weights, optimizer, position, RNG, data shares."""
    run.step_impl.restore(state, path)
    run.step_impl.task.load_state(state.get("extra") or {})
    run.step, run.epoch, run.skip = int(state["step"]), int(state["epoch"]), int(state["step_in_epoch"])
    weights = state.get("extra", {}).get("balance_weights")
    if int(state["world_size"]) == run.world:
        ckpt.restore_rng(state["rng"][run.rank])
    else:
        log.warning("checkpoint was written by %d ranks, this run has %d: RNG streams restart from "
                    "the seed (the run is no longer bit-identical to an uninterrupted one)",
                    state["world_size"], run.world)
    if weights is not None and len(weights) == run.world:
        run.weights = weights
    run.resumed_from = path
    if run.rank == 0:
        log.info("resumed from %s (step %d, epoch %d)", path, run.step, run.epoch)


# ---------------------------------------------------------------------------- data and outputs
def open_data(run: Run) -> None:
    """The training loader (from the run's data shares) and the test loader."""
    from hpctrain.data import HDF5Dataset

    cfg, plan = run.cfg, run.plan
    run.ds = run.train_set(run.weights)
    if cfg.data.test:
        run.test_ds = HDF5Dataset(cfg.data.test, keys=run.keys,
                                  batch_size=eval_batch_size(cfg.eval.batch_size, plan.test_samples, run.data_world),
                                  shuffle=False, drop_last=False, rank=run.data_rank, world_size=run.data_world,
                                  dtypes=run._dtypes(), prefetch=cfg.data.prefetch, driver=run._driver())


def open_outputs(run: Run, continuing: bool = False) -> None:
    """config.yaml, plan.json, metrics.jsonl, TensorBoard (rank 0) and the preemption handler.
    metrics.jsonl is appended to after a resume and when ``continuing`` (elastic re-forming)."""
    cfg, plan, rank = run.cfg, run.plan, run.rank
    if rank == 0:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        import yaml

        (run.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        (run.run_dir / "plan.json").write_text(json.dumps(asdict(plan), indent=1))
    run.metrics = MetricsWriter(run.run_dir / "metrics.jsonl" if rank == 0 else None,
                                append=run.resumed_from is not None or continuing)
    run.tb = tensorboard(cfg, run.run_dir) if rank == 0 else None
    if rank == 0:
        log.info("plan:\n%s", plan.describe())
        if run.resumed_from is not None:
            run.metrics.write({"kind": "event", "step": run.step, "what": "resume", "path": str(run.resumed_from)})
    if cfg.preemption and threading.current_thread() is threading.main_thread():
        from hpctrain.slurm import preempt

        run.guard = preempt.install()


def tensorboard(cfg: TrainConfig, run_dir: Path) -> Any:
    """A SummaryWriter under ``run_dir/tensorboard`` when ``tensorboard: true``."""
    if not cfg.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ConfigError("tensorboard: true needs the tensorboard package\n"
                          "HINT: pip install tensorboard, or set tensorboard: false") from exc
    return SummaryWriter(str(run_dir / "tensorboard"))


def build_run(cfg: TrainConfig, resume: Optional[str], plan: TrainPlan, rank: int, world: int,
              continuing: bool = False) -> Run:
    """Model, optimizer, resume, data and outputs of one run, in that order on every rank.
    ``continuing``: the same run rebuilt after an elastic job lost ranks (its outputs are
    appended to, even when there is no checkpoint to resume from)."""
    from hpctrain.train.steps import build_step

    model, device = build_model(cfg, plan, world)
    step_impl = build_step(cfg, model, plan, device, world, rank)
    from hpctrain.train.task import build_task

    step_impl.task = build_task(cfg, device, import_factory)
    seed_per_rank(cfg.seed, rank)
    step_impl.build_optimizer(plan.lr)
    data_rank, data_world = step_impl.data_rank, step_impl.data_world
    run = Run(cfg=cfg, rank=rank, world=world, plan=plan, model=step_impl.module, opt=step_impl.opt,
              step_impl=step_impl, timeline=attach_timeline(cfg, step_impl.opt, rank), run_dir=Path(cfg.run_dir),
              ckpt_dir=Path(cfg.checkpoint_dir), data_rank=data_rank, data_world=data_world,
              keys=step_impl.loader_keys(), weights=list(plan.weights) if plan.weights else None)
    step_impl.timeline = run.timeline
    slots = {"sgd": 1 if cfg.optimizer.momentum > 0 else 0, "adam": 2, "adamw": 2}[cfg.optimizer.name]
    agree_or_raise(lambda: preflight(cfg, run.ckpt_dir, ckpt.estimate_bytes(run.model, slots, world), resume,
                                     run.run_dir), rank)
    state, resumed_from = find_resume(resume, run.ckpt_dir, run.pipe is not None, rank)
    # carried through resumes (keep-last-K prunes only this run's files); rank 0's, so that
    # every rank writes the same one
    step_impl.run_id = comm.broadcast_object(ckpt.run_id_of(state), root=0)
    if state is not None:
        restore(run, state, resumed_from)  # type: ignore[arg-type]
        del state
    if run.weights is not None and tuple(run.weights) != plan.weights:
        run.plan = make_plan(cfg, [plan.train_samples], [plan.test_samples], world, plan.batch_size, run.weights)
    open_data(run)
    if cfg.data.normalize != "none" and step_impl.task.normalizer is None:
        step_impl.task.normalizer = normalizer_from_data(run)
    open_outputs(run, continuing)
    return run


def normalizer_from_data(run: Run) -> Any:
    """Collective: ``data.normalize`` statistics over every rank's share of the training data
    (read once, in order; a resumed run takes them from its checkpoint instead)."""
    from hpctrain.data import HDF5Dataset
    from hpctrain.train.task import compute_normalizer

    cfg = run.cfg
    xk = cfg.data.x_key
    ds = HDF5Dataset(cfg.data.train, keys=[xk], batch_size=run.plan.batch_size, policy="contiguous",
                     shuffle=False, drop_last=False, rank=run.data_rank, world_size=run.data_world,
                     dtypes={xk: cfg.data.dtypes.get("x", "float32")}, prefetch=0)
    try:
        return compute_normalizer(cfg, iter(ds), xk)
    finally:
        ds.close()
