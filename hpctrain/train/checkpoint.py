"""Checkpoints: atomic writes, keep-last-K, newest-valid lookup, safe loading, pre-flight checks.

One checkpoint is one file ``ckpt-<step:09d>.pt`` written by rank 0 with ``torch.save``:

    {"format": 1, "hpctrain_version": str, "step": int, "epoch": int, "step_in_epoch": int,
     "world_size": int, "model": state_dict, "optimizer": state_dict, "scheduler": state_dict,
     "rng": [per rank: {"torch": uint8 tensor, "numpy": {...}, "python": {...}}],
     "config": plain dict, "extra": plain dict}

Everything is tensors and plain Python types, so it loads with
``torch.load(weights_only=True)``: loading never unpickles arbitrary objects.

Atomicity: the bytes go to a temporary file in the same directory, which is flushed and
``fsync``-ed, then ``os.replace``-d onto the final name, then the directory is ``fsync``-ed.
A crash (even ``kill -9``) at any moment leaves either the old set of checkpoints or the old
set plus the complete new one — never a truncated file under a checkpoint name. Stale
temporary files are removed by the next write.
"""
from __future__ import annotations

import logging
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

import hpctrain

log = logging.getLogger("hpctrain.train")

FORMAT = 1
PATTERN = re.compile(r"^ckpt-(\d{9})\.pt$")
REQUIRED = ("format", "step", "epoch", "step_in_epoch", "model", "optimizer", "rng", "config")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file and the fix."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{int(step):09d}.pt"


# ---------------------------------------------------------------------------- RNG state
def capture_rng() -> Dict[str, Any]:
    """This process's RNG states (torch CPU and CUDA, numpy global, python random) as tensors/plain types."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    cuda = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), int(n["pos"]), int(n["has_gauss"]),
                         float(n["cached_gaussian"])))
    p = state["python"]
    random.setstate((int(p["version"]), tuple(int(v) for v in p["state"].tolist()), p["gauss_next"]))


# ---------------------------------------------------------------------------- files
def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(str(directory), os.O_RDONLY)
    except OSError:
        return  # e.g. a platform without directory fds
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path`` atomically (temp file in the same dir, fsync, replace, fsync dir)."""
    path = Path(path)
    directory = path.parent
    tmp = directory / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def list_checkpoints(directory: Path) -> List[Tuple[int, Path]]:
    """``[(step, path)]`` of the checkpoint files in ``directory``, newest (highest step) first."""
    return list_numbered(directory, PATTERN)


def list_numbered(directory: Path, pattern: "re.Pattern", directories: bool = False) -> List[Tuple[int, Path]]:
    """``[(step, path)]`` of the entries of ``directory`` whose name ``pattern`` matches (group 1:
    the step), newest first; with ``directories``, only directories."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for name in os.listdir(directory):
        m = pattern.match(name)
        if m and (not directories or (directory / name).is_dir()):
            found.append((int(m.group(1)), directory / name))
    return sorted(found, reverse=True)


def load_checkpoint(path: Path) -> Dict[str, Any]:
    """Load and check one checkpoint (``weights_only=True``: no arbitrary unpickling)."""
    path = Path(path)
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: no such checkpoint file") from exc
    except Exception as exc:  # truncated, corrupt, or not a torch file
        raise CheckpointError(f"{path}: cannot be loaded ({type(exc).__name__}: {exc})\n"
                              "HINT: pass --resume auto to use the newest checkpoint that loads") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, expected an hpctrain checkpoint dict")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"{path}: not an hpctrain checkpoint (missing {', '.join(missing)})")
    if state["format"] != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state['format']!r}; this hpctrain reads format {FORMAT}")
    return state


def newest_valid(directory: Path) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The newest checkpoint in ``directory`` that loads, with its contents (None if none does).

    Files that fail to load (truncated by a crash on a file system without atomic rename,
    corrupted later) are skipped with a warning naming them.
    """
    for _step, path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint that does not load: %s", exc)
    return None


def prune(directory: Path, keep: int) -> List[Path]:
    """Delete all but the newest ``keep`` checkpoints, and stale temporary files; return what went."""
    removed: List[Path] = []
    for _step, path in list_checkpoints(directory)[keep:]:
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    for name in os.listdir(directory):
        if name.startswith(".ckpt-") and ".tmp-" in name:
            pid = name.rsplit(".tmp-", 1)[1].split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                try:
                    (Path(directory) / name).unlink()
                    removed.append(Path(directory) / name)
                except OSError:
                    pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Saved:
    """What :func:`save` wrote."""

    path: Path
    step: int
    nbytes: int


def build_state(*, step: int, epoch: int, step_in_epoch: int, model: torch.nn.Module, optimizer: Any,
                scheduler: Optional[Mapping[str, Any]], rng: Sequence[Mapping[str, Any]], config: Mapping[str, Any],
                extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The checkpoint dict (see the module docstring)."""
    return {
        "format": FORMAT,
        "hpctrain_version": hpctrain.__version__,
        "torch_version": str(torch.__version__),
        "step": int(step),
        "epoch": int(epoch),
        "step_in_epoch": int(step_in_epoch),
        "world_size": len(rng),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": dict(scheduler or {}),
        "rng": list(rng),
        "config": dict(config),
        "extra": dict(extra or {}),
    }


def save(directory: Path, state: Mapping[str, Any], keep: int) -> Saved:
    """Write ``state`` as the checkpoint of ``state["step"]`` atomically, then keep the newest ``keep``."""
    directory = Path(directory)
    path = directory / checkpoint_name(state["step"])
    try:
        atomic_save(dict(state), path)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc}\n"
                              f"HINT: free space in {directory} or point checkpoint.dir elsewhere") from exc
    prune(directory, keep)
    return Saved(path, int(state["step"]), path.stat().st_size)


# ---------------------------------------------------------------------------- pre-flight
def estimate_bytes(model: torch.nn.Module, optimizer_slots: int, world_size: int) -> int:
    """Rough size of one checkpoint: weights, optimizer state, per-rank RNG, 1 MiB slack."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    per_rank_rng = 5056 + 624 * 8 + 625 * 8 + 256
    return int(weights * (1 + optimizer_slots) + world_size * per_rank_rng + (1 << 20))


def space_problem(free_bytes: int, estimate: int, keep: int) -> Optional[str]:
    """None when ``free_bytes`` can hold the next checkpoint with margin; else what is wrong.

    Pure (unit-tested). A write needs room for the new file while the old ones still exist:
    at least two checkpoints' worth of free space.
    """
    need = 2 * estimate
    if free_bytes < need:
        return (f"{free_bytes / 2**20:.1f} MiB free, but a checkpoint needs about {estimate / 2**20:.1f} MiB "
                f"and writing one safely needs {need / 2**20:.1f} MiB (keep={keep})")
    return None


def preflight(directory: Path, estimate: int, keep: int) -> None:
    """Fail before training starts when ``directory`` cannot take checkpoints: it cannot be
    created, is not writable (checked by writing and fsync-ing a probe file), or is too full."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {str(directory)!r} cannot be created: {exc.strerror or exc}\n"
                              "HINT: set checkpoint.dir to a writable directory on a shared file system") from exc
    probe = directory / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {str(directory)!r} is not writable: {exc.strerror or exc}\n"
                              "HINT: fix its permissions, free space, or set checkpoint.dir elsewhere") from exc
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    free = shutil.disk_usage(directory).free
    problem = space_problem(free, estimate, keep)
    if problem:
        raise CheckpointError(f"checkpoint directory {str(directory)!r} is too full: {problem}\n"
                              "HINT: free space there, or set checkpoint.dir to a larger file system")
