"""The runner's pipeline mode: ``parallel: {pipeline_stages: S, micro_batches: M, schedule: …}``.

World = DP × S (:mod:`hpctrain.parallel.hybrid`): world rank ``r`` is stage ``r // DP`` of
replica ``r % DP``. What changes against plain data parallelism, piece by piece:

- **plan**: the data is shared among the DP *replicas*, not the ranks (every rank of one
  pipeline reads the same batches: the loader runs with ``rank=replica, world_size=DP``);
  learning-rate scaling and the global batch count replicas.
- **data**: stage 0 reads ``x``, the other stages only ``y`` (the last stage needs the
  targets; a middle stage only the batch length); the padding mask comes with every batch.
- **step**: :meth:`PipelineModule.train_step` with a masked-sum loss normalised by the global
  batch (the same normalisation as the data-parallel loop, so the DP average of the stage
  gradients is the gradient of the global batch-mean loss); the stage gradients are averaged
  over the stage's data-parallel group by ``DistributedOptimizer(process_set=dp_group)``.
- **metrics**: the loss, real-sample count and correct predictions exist on the last stage;
  they reach rank 0 through the runner's per-step gather (other stages contribute zeros).
- **checkpoints**: one directory ``pipeline-<step:09d>/`` per checkpoint holding one
  ``stage-<s>-of-<S>.pt`` per stage (weights and optimizer state, written by replica 0 of the
  stage) and ``meta.pt`` (step, epoch, every rank's RNG, config). The stage files are written
  into a temporary directory that rank 0 renames once all of them and ``meta.pt`` are complete:
  a crash leaves the old checkpoints or the complete new one. ``python -m
  hpctrain.parallel.checkpoint merge DIR -o model.pt`` turns one into an ordinary state_dict.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import hpctrain
from hpctrain import comm
from hpctrain.parallel import ParallelConfig
from hpctrain.parallel import checkpoint as stage_ckpt
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.config import ConfigError, TrainConfig

log = logging.getLogger("hpctrain.train")

META_FORMAT = "hpctrain.pipeline-run/1"
PATTERN = re.compile(r"^pipeline-(\d{9})$")
META_NAME = "meta.pt"


def parallel_config(cfg: TrainConfig) -> ParallelConfig:
    """The validated ``parallel:`` section (ConfigError on bad values)."""
    try:
        return ParallelConfig.from_dict(cfg.parallel or None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_runner_options(cfg: TrainConfig, pc: ParallelConfig) -> None:
    """Options of ``cfg`` that a pipeline run cannot honour (pure; ConfigError)."""
    if not pc.enabled:
        return
    problems = []
    if cfg.sync.strategy != "allreduce":
        problems.append(f"sync.strategy: {cfg.sync.strategy!r} (a pipeline averages stage gradients with "
                        "allreduce; set sync.strategy: allreduce)")
    if cfg.sync.backend != "mpi":
        problems.append(f"sync.backend: {cfg.sync.backend!r} (stage gradients are averaged over a data-parallel "
                        "group, which only the mpi backend supports; set sync.backend: mpi)")
    if cfg.balance != "off":
        problems.append("balance: auto (re-weighting data shares is per rank, a pipeline shares data per "
                        "replica; set balance: off)")
    if cfg.batch_size == "auto":
        problems.append("batch_size: auto (the tuner measures a whole model on one rank; give the per-replica "
                        "batch, e.g. batch_size: 64)")
    if cfg.checkpoint.keep_best:
        problems.append("checkpoint.keep_best (pipeline checkpoints are one folder per step; export the newest "
                        "with hpctrain export)")
    if cfg.precision != "fp32":
        problems.append(f"precision: {cfg.precision} (stages exchange fp32 activations; set precision: fp32)")
    if problems:
        raise ConfigError(f"parallel.pipeline_stages: {pc.pipeline_stages} cannot be combined with "
                          + "; ".join(problems))


def check_world(pc: ParallelConfig, world: int) -> int:
    """The number of data-parallel replicas; ConfigError when ``world`` ranks cannot run the
    stages (pure, before any communication)."""
    from hpctrain.parallel import check_world as _check

    try:
        _check(world, pc.pipeline_stages)
    except ValueError as exc:
        raise ConfigError(f"parallel.pipeline_stages: {exc}") from None
    return world // pc.pipeline_stages


def check_model(pc: ParallelConfig, model: Any, world: int, factory: str) -> None:
    """ConfigError unless ``model`` can be split into the configured stages (pure)."""
    try:
        pc.check(model, world)
    except ValueError as exc:
        raise ConfigError(f"parallel: model.factory {factory!r} returned {type(model).__name__}: {exc}") from None


def check_batch(pc: ParallelConfig, rank_batch_sizes: Sequence[int]) -> None:
    """Every replica's batch must split into M micro-batches of at least one row."""
    small = min(rank_batch_sizes)
    if small < pc.micro_batches:
        raise ConfigError(f"batch_size: a replica's batch of {small} row(s) cannot be cut into parallel.micro_batches="
                          f"{pc.micro_batches} micro-batches\nHINT: raise batch_size to at least "
                          f"{pc.micro_batches} (a multiple of it for equal micro-batches) or lower micro_batches")


class Targets:
    """The targets and the padding mask of a batch, sliced together (the pipeline cuts
    micro-batches with ``targets[a:b]`` and moves them with ``.to(device)``)."""

    __slots__ = ("y", "mask")

    def __init__(self, y: torch.Tensor, mask: torch.Tensor) -> None:
        self.y, self.mask = y, mask

    def __len__(self) -> int:
        return len(self.mask)

    def __getitem__(self, rows: slice) -> "Targets":
        return Targets(self.y[rows], self.mask[rows])

    def to(self, device: Any, non_blocking: bool = False) -> "Targets":
        return Targets(self.y.to(device, non_blocking=non_blocking), self.mask.to(device, non_blocking=non_blocking))


def loader_keys(stage: int, stages: int, xk: str, yk: str) -> List[str]:
    """What a stage reads from the HDF5 files: x on stage 0, y elsewhere (the last stage's
    targets; a middle stage needs only the batch length and mask)."""
    return [xk] if stage == 0 else [yk]


# ---------------------------------------------------------------------------- checkpoints
def checkpoint_name(step: int) -> str:
    return f"pipeline-{int(step):09d}"


def list_checkpoints(directory: Path) -> List[Tuple[int, Path]]:
    """``[(step, dir)]`` of the pipeline checkpoints in ``directory``, newest first."""
    return ckpt.list_numbered(directory, PATTERN, directories=True)


def load_meta(path: Path) -> Dict[str, Any]:
    """Read and check one pipeline checkpoint directory's ``meta.pt`` and that every stage file
    is present (``weights_only``: no arbitrary unpickling)."""
    path = Path(path)
    meta_path = path / META_NAME
    if not path.is_dir():
        raise ckpt.CheckpointError(f"{path}: not a pipeline checkpoint directory (pipeline-<step>/)\n"
                                   "HINT: pass --resume auto, or a pipeline-<step> directory of the checkpoint dir")
    try:
        meta = torch.load(str(meta_path), map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ckpt.CheckpointError(f"{path}: has no {META_NAME}; not a complete pipeline checkpoint") from exc
    except Exception as exc:  # truncated, corrupt
        raise ckpt.CheckpointError(f"{meta_path}: cannot be loaded ({type(exc).__name__}: {exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise ckpt.CheckpointError(f"{meta_path}: not an hpctrain pipeline checkpoint (format {META_FORMAT!r})")
    missing = [s for s in range(int(meta["stages"]))
               if not os.path.isfile(stage_ckpt.stage_checkpoint_path(str(path), s, int(meta["stages"])))]
    if missing:
        raise ckpt.CheckpointError(f"{path}: stage file(s) of stage(s) {missing} are missing")
    return meta


def newest_valid(directory: Path) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The newest complete pipeline checkpoint (skipping broken ones with a warning)."""
    for _step, path in list_checkpoints(directory):
        try:
            return path, load_meta(path)
        except ckpt.CheckpointError as exc:
            log.warning("skipping pipeline checkpoint that does not load: %s", exc)
    return None


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` pipeline checkpoints, and temporary directories left
    by a crashed save (rank 0 saves one checkpoint at a time, so any other is stale)."""
    directory = Path(directory)
    for _step, path in list_checkpoints(directory)[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(directory):
        if name.startswith(".pipeline-") and name.endswith(".tmp"):
            shutil.rmtree(directory / name, ignore_errors=True)


def save(directory: Path, pipe: Any, opt: Any, meta: Dict[str, Any], keep: int) -> str:
    """Collective (every rank): write the checkpoint of ``meta["step"]``; returns its path.
    Raises CheckpointError on every rank when any rank failed to write."""
    directory = Path(directory)
    step = int(meta["step"])
    final = directory / checkpoint_name(step)
    tmp = directory / f".{checkpoint_name(step)}.tmp"
    problem: Optional[str] = None
    if comm.rank() == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as exc:
            problem = f"cannot create {tmp}: {exc}"
    problem = comm.broadcast_object(problem, root=0)
    if problem is not None:
        raise ckpt.CheckpointError(problem + "\nHINT: free space or fix permissions in checkpoint.dir")
    mine: Optional[str] = None
    if pipe.replica == 0:
        try:
            ckpt.atomic_save(stage_ckpt.stage_state(pipe, opt),
                             Path(stage_ckpt.stage_checkpoint_path(str(tmp), pipe.stage, pipe.stages)))
        except OSError as exc:
            mine = f"rank {comm.rank()} (stage {pipe.stage}): {exc}"
    everyone = comm.allgather_object((mine, ckpt.capture_rng()))
    result: Any = None
    if comm.rank() == 0:
        errors = [e for e, _ in everyone if e is not None]
        if errors:
            result = ("error", "cannot write pipeline checkpoint: " + "; ".join(errors))
        else:
            try:
                ckpt.atomic_save({**meta, "rng": [r for _, r in everyone], "world_size": len(everyone)},
                                 tmp / META_NAME)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                ckpt._fsync_dir(directory)
                prune(directory, keep)
                result = ("ok", str(final))
            except OSError as exc:
                result = ("error", f"cannot write pipeline checkpoint {final}: {exc}")
        if result[0] == "error":
            shutil.rmtree(tmp, ignore_errors=True)
    result = comm.broadcast_object(result, root=0)
    if result[0] == "error":
        raise ckpt.CheckpointError(result[1] + "\nHINT: free space in checkpoint.dir or point it elsewhere")
    return result[1]


def build_meta(*, step: int, epoch: int, step_in_epoch: int, pipe: Any, config: Dict[str, Any],
               extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``meta.pt`` without the RNG states (:func:`save` adds every rank's)."""
    return {
        "format": META_FORMAT,
        "hpctrain_version": hpctrain.__version__,
        "step": int(step), "epoch": int(epoch), "step_in_epoch": int(step_in_epoch),
        "stages": int(pipe.stages), "data_parallel": int(pipe.layout.data_parallel if pipe.layout else 1),
        "split_points": list(pipe.plan.split_points), "schedule": pipe.schedule,
        "micro_batches": int(pipe.micro_batches), "config": dict(config), "extra": dict(extra or {}),
    }


def load(path: Path, pipe: Any, opt: Any) -> Dict[str, Any]:
    """Load this rank's stage (weights, optimizer state) from the checkpoint ``path``; returns
    its meta. Same checks on every rank (same files), so every rank raises alike."""
    meta = load_meta(path)
    if int(meta["stages"]) != pipe.stages or list(meta["split_points"]) != list(pipe.plan.split_points):
        raise ckpt.CheckpointError(
            f"{path} holds a pipeline of {meta['stages']} stages split at {meta['split_points']}, but this run has "
            f"{pipe.stages} stages split at {list(pipe.plan.split_points)}.\nHINT: resume with the same "
            "parallel: settings, or merge it (python -m hpctrain.parallel.checkpoint merge) and start a new run")
    try:
        stage_ckpt.load_stage_checkpoint(pipe, str(path), optimizer=opt)
    except stage_ckpt.CheckpointError as exc:
        raise ckpt.CheckpointError(str(exc)) from None
    return meta
