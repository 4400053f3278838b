"""Checkpoints: atomic writes, keep-last-K, newest-valid lookup, safe loading, pre-flight checks.

One checkpoint is one file ``ckpt-<step:09d>.pt`` written by rank 0 with ``torch.save``:

    {"format": 1, "hpctrain_version": str, "run_id": str, "step": int, "epoch": int,
     "step_in_epoch": int, "world_size": int, "model": state_dict, "optimizer": state_dict,
     "scheduler": state_dict, "rng": [per rank: {"torch": uint8 tensor, "numpy": {...}, "python": {...}}],
     "config": plain dict, "extra": plain dict}

Everything is tensors and plain Python types (:func:`hpctrain.serialization.to_plain` on
save), so it loads with ``torch.load(weights_only=True)``: loading never unpickles arbitrary
objects, and a file that needs more is refused as not a valid hpctrain checkpoint.

Keep-last-K (:func:`plan_prune`): the run id, made at a run's first start and carried through
every resume, tells this run's checkpoints from anything else in the directory. Only this
run's checkpoints that load are counted and deleted; the one just written is never touched.
What does not load is moved into ``quarantine/`` (never deleted, since hpctrain cannot tell
that it wrote it); this run's checkpoints newer than the one just written (the run was resumed
from an older step) are moved into ``superseded/``, so that ``--resume auto`` continues the
resumed run rather than the abandoned one; other runs' files are left alone.

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
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

import hpctrain
from hpctrain.serialization import NotPlainFile, load_plain, to_plain

log = logging.getLogger("hpctrain.train")

FORMAT = 1
PATTERN = re.compile(r"^ckpt-(\d{9})\.pt$")
REQUIRED = ("format", "step", "epoch", "step_in_epoch", "model", "optimizer", "rng", "config")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file and the fix."""


class ForeignFile(CheckpointError):
    """A file under a checkpoint name that loads, but is not an hpctrain checkpoint of this
    kind and format (pruning leaves such files alone)."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{int(step):09d}.pt"


def new_run_id() -> str:
    """A fresh run identity (recorded in every checkpoint of the run)."""
    return uuid.uuid4().hex


def run_id_of(state: Optional[Mapping[str, Any]]) -> str:
    """The run id to write: the resumed checkpoint's (or meta's), else a new one (a fresh
    start, or a checkpoint written before run ids existed)."""
    rid = state.get("run_id") if state is not None else None
    return rid if isinstance(rid, str) and rid else new_run_id()


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


def load_checkpoint(path: Path, *, mmap: bool = False) -> Dict[str, Any]:
    """Load and check one checkpoint (``weights_only=True``: no arbitrary unpickling).

    ``mmap``: map the tensors instead of reading them (a cheap look at the metadata)."""
    path = Path(path)
    try:
        state = load_plain(path, mmap=mmap)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: no such checkpoint file\nHINT: pass --resume auto to take the newest "
                              "valid checkpoint of the run, or the path of a ckpt-<step>.pt file") from exc
    except NotPlainFile as exc:
        raise CheckpointError(f"{exc}\nHINT: pass --resume auto to use the newest checkpoint that loads") from None
    if not isinstance(state, dict):
        raise ForeignFile(f"{path}: not an hpctrain checkpoint (holds a {type(state).__name__}, "
                          "expected an hpctrain checkpoint dict)")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise ForeignFile(f"{path}: not an hpctrain checkpoint (missing {', '.join(missing)})")
    if state["format"] != FORMAT:
        raise ForeignFile(f"{path}: checkpoint format {state['format']!r}; this hpctrain reads format {FORMAT}")
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
            log.warning("skipping checkpoint that does not load: %s", str(exc).splitlines()[0])
    return None


# ---------------------------------------------------------------------------- keep-last-K
OURS, OTHER, BROKEN = "ours", "other", "broken"


@dataclass(frozen=True)
class Entry:
    """One checkpoint in a directory, as pruning sees it. ``kind``: OURS (loads and carries
    this run's id), OTHER (loads, but another run's or no run id, or not hpctrain's), BROKEN
    (does not load: truncated, corrupt, or holding pickled objects)."""

    step: int
    path: Path
    kind: str
    why: str = ""


@dataclass(frozen=True)
class PrunePlan:
    """What :func:`plan_prune` decided; every path not named here stays where it is."""

    delete: Tuple[Path, ...] = ()
    quarantine: Tuple[Path, ...] = ()
    supersede: Tuple[Path, ...] = ()


def plan_prune(entries: Sequence[Entry], keep: int, written_step: int) -> PrunePlan:
    """Pure. ``entries``: the directory's checkpoints other than the one just written (of
    ``written_step``). The written one counts as the newest of the ``keep``; of this run's
    older checkpoints the newest ``keep - 1`` stay and the rest are deleted. Nothing else is
    ever deleted: BROKEN entries are quarantined, this run's newer ones superseded."""
    if keep < 1:
        raise ValueError(f"keep={keep}: at least the checkpoint just written is kept")
    ours = sorted((e for e in entries if e.kind == OURS), key=lambda e: e.step, reverse=True)
    older = [e.path for e in ours if e.step < written_step]
    return PrunePlan(delete=tuple(older[keep - 1:]),
                     quarantine=tuple(e.path for e in entries if e.kind == BROKEN),
                     supersede=tuple(e.path for e in ours if e.step >= written_step))


def classify(path: Path, run_id: str) -> Entry:
    """The :class:`Entry` of a ``ckpt-*.pt`` file: it is loaded with ``weights_only`` and its
    tensors only mapped, so this is cheap even for a large checkpoint."""
    m = PATTERN.match(path.name)
    step = int(m.group(1)) if m else -1
    try:
        state = load_checkpoint(path, mmap=True)
    except CheckpointError as exc:
        return entry_for_error(step, path, exc)
    return entry_for_run(step, path, state.get("run_id"), run_id)


def entry_for_error(step: int, path: Path, exc: CheckpointError) -> Entry:
    """The Entry of a checkpoint that failed to load with ``exc``."""
    why = str(exc).splitlines()[0]
    why = why[len(f"{path}: "):] if why.startswith(f"{path}: ") else why
    return Entry(step, path, OTHER if isinstance(exc, ForeignFile) else BROKEN, why)


def entry_for_run(step: int, path: Path, found: Any, run_id: str) -> Entry:
    """The Entry of a checkpoint that loads and carries run id ``found``."""
    if found == run_id:
        return Entry(step, path, OURS)
    if not found:
        return Entry(step, path, OTHER, "a checkpoint without a run id (written by an older hpctrain)")
    return Entry(step, path, OTHER, f"a checkpoint of another run (run id {found})")


def move_aside(path: Path, folder: str, why: str) -> Optional[Path]:
    """Move ``path`` into ``<its directory>/<folder>/`` under a free name, with a warning
    naming both; returns the new path (None if it vanished or could not be moved)."""
    target_dir = path.parent / folder
    try:
        target_dir.mkdir(exist_ok=True)
        target = target_dir / path.name
        n = 0
        while target.exists():
            n += 1
            target = target_dir / f"{path.name}.{n}"
        os.rename(path, target)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("%s: %s, but it could not be moved to %s/ (%s); left in place", path, why, folder, exc)
        return None
    log.warning("moved %s to %s: %s (nothing was deleted)", path, target, why)
    return target


def apply_prune(plan: PrunePlan, entries: Sequence[Entry], remove: Callable[[Path], Any]) -> List[Path]:
    """Carry out ``plan`` (``remove(path)`` deletes one checkpoint); returns what was deleted."""
    why = {e.path: e.why for e in entries}
    for path in plan.quarantine:
        move_aside(path, "quarantine", why.get(path) or "it does not load")
    for path in plan.supersede:
        move_aside(path, "superseded", "this run was resumed from an older step, and this checkpoint of the "
                                       "abandoned continuation would otherwise be resumed by --resume auto")
    removed = []
    for path in plan.delete:
        try:
            remove(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # the checkpoint just written is safe: pruning is best effort
            log.warning("could not delete old checkpoint %s: %s", path, exc)
    return removed


def clear_target(entry: Entry) -> None:
    """Before a checkpoint is written under ``entry``'s name: what this run did not write, or
    what does not load, is moved aside rather than replaced."""
    if entry.kind == BROKEN:
        move_aside(entry.path, "quarantine", entry.why)
    elif entry.kind == OTHER:
        move_aside(entry.path, "superseded", f"{entry.why}, and this run writes a checkpoint under its name")


def prune(directory: Path, keep: int, *, run_id: str, written: Path) -> List[Path]:
    """Keep-last-``keep`` after ``written`` was saved (see :func:`plan_prune`), and remove
    stale temporary files of dead writers; returns what was deleted."""
    directory, written = Path(directory), Path(written)
    entries = [classify(p, run_id) for _s, p in list_checkpoints(directory) if p.name != written.name]
    removed = apply_prune(plan_prune(entries, keep, int(PATTERN.match(written.name).group(1))), entries, os.unlink)
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
                run_id: str, extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The checkpoint dict (see the module docstring), in plain types only."""
    return to_plain({
        "format": FORMAT,
        "hpctrain_version": hpctrain.__version__,
        "torch_version": str(torch.__version__),
        "run_id": str(run_id),
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
    })


def save(directory: Path, state: Mapping[str, Any], keep: int) -> Saved:
    """Write ``state`` as the checkpoint of ``state["step"]`` atomically, then prune to the
    newest ``keep`` of this run (``state["run_id"]``; see :func:`plan_prune`)."""
    directory = Path(directory)
    run_id = state.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError("a checkpoint state needs a run_id (build_state(run_id=run_id_of(resumed_state)))")
    path = directory / checkpoint_name(state["step"])
    if path.exists():
        clear_target(classify(path, run_id))
    try:
        atomic_save(dict(state), path)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc}\n"
                              f"HINT: free space in {directory} or point checkpoint.dir elsewhere") from exc
    saved = Saved(path, int(state["step"]), path.stat().st_size)
    prune(directory, keep, run_id=run_id, written=path)
    return saved


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
