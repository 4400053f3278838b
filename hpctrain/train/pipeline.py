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
from hpctrain.serialization import NotPlainFile, load_plain, to_plain
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
    if len(cfg.data.x_keys) > 1:
        problems.append("data.keys.x with several inputs (a pipeline's first stage takes one tensor; use one "
                        "input key)")
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
    """Read and check one pipeline checkpoint directory: its ``meta.pt``, and that every stage
    file is there and loads as a stage file (``weights_only``: no arbitrary unpickling; the
    stage files' tensors are only mapped, not read)."""
    path = Path(path)
    meta_path = path / META_NAME
    if not path.is_dir():
        raise ckpt.CheckpointError(f"{path}: not a pipeline checkpoint directory (pipeline-<step>/)\n"
                                   "HINT: pass --resume auto, or a pipeline-<step> directory of the checkpoint dir")
    try:
        meta = load_plain(meta_path)
    except FileNotFoundError as exc:
        raise ckpt.CheckpointError(f"{path}: has no {META_NAME}; not a complete pipeline checkpoint") from exc
    except NotPlainFile as exc:
        raise ckpt.CheckpointError(str(exc)) from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise ckpt.ForeignFile(f"{meta_path}: not an hpctrain pipeline checkpoint (format {META_FORMAT!r})")
    stages = meta.get("stages")
    if type(stages) is not int or stages < 1:
        raise ckpt.CheckpointError(f"{meta_path}: not a valid hpctrain checkpoint: stages is {stages!r}")
    missing = [s for s in range(stages) if not os.path.isfile(stage_ckpt.stage_checkpoint_path(str(path), s, stages))]
    if missing:
        raise ckpt.CheckpointError(f"{path}: stage file(s) of stage(s) {missing} are missing")
    for s in range(stages):
        try:
            stage_ckpt.read_stage_file(stage_ckpt.stage_checkpoint_path(str(path), s, stages), mmap=True)
        except stage_ckpt.CheckpointError as exc:
            raise ckpt.CheckpointError(str(exc)) from None
    return meta


def newest_valid(directory: Path) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The newest complete pipeline checkpoint (skipping broken ones with a warning)."""
    for _step, path in list_checkpoints(directory):
        try:
            return path, load_meta(path)
        except ckpt.CheckpointError as exc:
            log.warning("skipping pipeline checkpoint that does not load: %s", exc)
    return None


def classify(path: Path, run_id: str) -> ckpt.Entry:
    """A pipeline checkpoint directory as keep-last-K sees it (:func:`ckpt.plan_prune`)."""
    step = int(PATTERN.match(path.name).group(1))
    try:
        meta = load_meta(path)
    except ckpt.CheckpointError as exc:
        return ckpt.entry_for_error(step, path, exc)
    return ckpt.entry_for_run(step, path, meta.get("run_id"), run_id)


def prune(directory: Path, keep: int, *, run_id: str, written: Path) -> List[Path]:
    """Keep-last-``keep`` of this run after ``written`` was saved (the rules of
    :func:`ckpt.plan_prune`), and remove temporary directories left by a crashed save (rank 0
    saves one checkpoint at a time, so any other is stale); returns what was deleted."""
    directory, written = Path(directory), Path(written)
    entries = [classify(p, run_id) for _s, p in list_checkpoints(directory) if p.name != written.name]
    plan = ckpt.plan_prune(entries, keep, int(PATTERN.match(written.name).group(1)))
    removed = ckpt.apply_prune(plan, entries, shutil.rmtree)
    for name in os.listdir(directory):
        if name.startswith(".pipeline-") and name.endswith(".tmp"):
            shutil.rmtree(directory / name, ignore_errors=True)
    return removed


def save(directory: Path, pipe: Any, opt: Any, meta: Dict[str, Any], keep: int) -> str:
    """Collective (every rank): write the checkpoint of ``meta["step"]``; returns its path.
    Raises CheckpointError on every rank when any rank failed to write."""
    directory = Path(directory)
    if not isinstance(meta.get("run_id"), str) or not meta["run_id"]:
        raise ValueError("pipeline checkpoint meta needs a run_id (build_meta(run_id=...))")
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
            result = _publish(directory, tmp, final, {**meta, "rng": [r for _, r in everyone],
                                                      "world_size": len(everyone)}, keep)
        if result[0] == "error":
            shutil.rmtree(tmp, ignore_errors=True)
    result = comm.broadcast_object(result, root=0)
    if result[0] == "error":
        raise ckpt.CheckpointError(result[1] + "\nHINT: free space in checkpoint.dir or point it elsewhere")
    return result[1]


def _publish(directory: Path, tmp: Path, final: Path, meta: Dict[str, Any], keep: int) -> Tuple[str, str]:
    """Rank 0: write ``meta.pt`` into the complete ``tmp`` directory, rename it to ``final``
    and prune. What is under ``final``'s name already is replaced only if it is this run's."""
    run_id = meta["run_id"]
    try:
        ckpt.atomic_save(to_plain(meta, "meta"), tmp / META_NAME)
        if final.exists():
            entry = classify(final, run_id)
            if entry.kind == ckpt.OURS:
                shutil.rmtree(final)
            else:
                ckpt.clear_target(entry)
        os.replace(tmp, final)
        ckpt._fsync_dir(directory)
    except OSError as exc:
        return ("error", f"cannot write pipeline checkpoint {final}: {exc}")
    prune(directory, keep, run_id=run_id, written=final)
    return ("ok", str(final))


def build_meta(*, step: int, epoch: int, step_in_epoch: int, pipe: Any, config: Dict[str, Any],
               run_id: str, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``meta.pt`` without the RNG states (:func:`save` adds every rank's)."""
    return {
        "format": META_FORMAT,
        "hpctrain_version": hpctrain.__version__,
        "run_id": str(run_id),
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
    problem: Optional[str] = None
    try:
        stage_ckpt.load_stage_checkpoint(pipe, str(path), optimizer=opt)
    except stage_ckpt.CheckpointError as exc:
        problem = str(exc)
    except (RuntimeError, KeyError, ValueError) as exc:  # tensors or optimizer state that do not fit
        problem = (f"{path}: stage {pipe.stage} does not load into this model "
                   f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''})\n"
                   "HINT: resume with the model and parallel: settings of the run that wrote it")
    # Each rank reads its own stage file: agree, so that a bad file fails every rank alike
    # instead of leaving the others waiting in the first collective.
    problems = [p for p in comm.allgather_object(problem) if p is not None]
    if problems:
        raise ckpt.CheckpointError(problems[0])
    return meta
