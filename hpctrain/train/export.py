"""Use a trained model: pick a run's checkpoint, rebuild the model from the config stored in
it, load the weights, apply the input normalisation the run recorded; export a plain
``state_dict`` and TorchScript.

    import hpctrain
    model = hpctrain.load_model("runs/digits")      # eval mode, newest checkpoint's weights
    predictions = model(x).argmax(dim=1)

Checkpoints are read with ``torch.load(weights_only=True)`` only: nothing is unpickled. The
model is built by calling the config's ``model.factory`` with ``model.kwargs`` — the same
code the run trained, so the factory file or module must still be importable.

Input normalisation: when the checkpoint holds ``normalize`` (at the top level or under
``extra``) as ``{mean, std}`` or ``{min, max}`` tensors (or a list of them, one per model
input), :func:`load_model` returns the model wrapped in :class:`Normalized`, which maps each
input to ``(x - shift) / scale`` first (``shift, scale = mean, std`` or ``min, max - min``).
"""
from __future__ import annotations

import logging
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

log = logging.getLogger("hpctrain.train")

PathLike = Union[str, "os.PathLike[str]"]


class ExportError(ValueError):
    """No usable checkpoint, a model that cannot be rebuilt or exported; the message says why and what to do."""


@dataclass(frozen=True)
class Loaded:
    """A checkpoint's weights and what is needed to rebuild and feed its model."""

    path: Path
    step: int
    weights: "OrderedDict[str, torch.Tensor]"
    config: Dict[str, Any]
    normalize: Any


# ---------------------------------------------------------------------------- finding checkpoints
def checkpoint_dir(run_dir: PathLike) -> Path:
    """Where ``run_dir``'s checkpoints are: ``checkpoint.dir`` of its ``config.yaml`` if set,
    else ``run_dir/checkpoints``; ``run_dir`` itself when it holds the checkpoint files."""
    import yaml

    from hpctrain.train import checkpoint as ckpt
    from hpctrain.train import pipeline as pp

    run = Path(run_dir)
    if not run.is_dir():
        raise ExportError(f"run directory {str(run)!r} does not exist\n"
                          "HINT: pass the run_dir of the training config (it holds config.yaml and checkpoints/)")
    if ckpt.list_checkpoints(run) or pp.list_checkpoints(run) or _best_entries(run):
        return run
    configured = ""
    if (run / "config.yaml").is_file():
        raw = yaml.safe_load((run / "config.yaml").read_text()) or {}
        configured = str(((raw.get("checkpoint") or {}).get("dir")) or "")
    if configured and Path(configured).is_dir():
        return Path(configured)
    return run / "checkpoints"


def _best_entries(directory: Path) -> List[Path]:
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir()
            if "best" in p.name and not p.name.startswith(".") and (p.suffix == ".pt" or p.is_dir())]


def find_checkpoint(run_dir: PathLike, best: bool = False) -> Path:
    """The checkpoint to use: the newest ``ckpt-*.pt`` (or ``pipeline-*/``) that loads, or with
    ``best`` the newest file (or pipeline directory) with ``best`` in its name."""
    from hpctrain.train import checkpoint as ckpt
    from hpctrain.train import pipeline as pp

    directory = checkpoint_dir(run_dir)
    if best:
        found = sorted(_best_entries(directory), key=lambda p: p.stat().st_mtime, reverse=True)
        if not found:
            raise ExportError(f"no best checkpoint (a file with 'best' in its name) in {directory}\n"
                              "HINT: train with checkpoint.keep_best: METRIC, or leave out --best for the newest "
                              "checkpoint")
        return found[0]
    newest = ckpt.newest_valid(directory) or pp.newest_valid(directory)
    if newest is None:
        raise ExportError(f"no checkpoint that loads in {directory}\n"
                          "HINT: train with checkpoint: {enabled: true}, or pass --checkpoint PATH")
    return Path(newest[0])


def _torch_load(path: Path) -> Any:
    """Through hpctrain's one loader (weights_only; a refusal is one line naming the file)."""
    from hpctrain.serialization import NotPlainFile, load_plain

    try:
        return load_plain(path)
    except FileNotFoundError:
        raise ExportError(f"{path}: no such checkpoint file") from None
    except NotPlainFile as exc:
        raise ExportError(f"{exc}\nHINT: pass an hpctrain checkpoint (ckpt-<step>.pt or a pipeline-<step>/ "
                          "directory)") from None


def read_checkpoint(path: PathLike) -> Loaded:
    """Weights, config and normalisation of a ``ckpt-*.pt`` file or a ``pipeline-*/`` directory
    (stage files merged into the original model's ``state_dict``)."""
    from hpctrain.parallel.checkpoint import CheckpointError, merge_stage_checkpoints

    path = Path(path)
    if path.is_dir():
        meta = _torch_load(path / "meta.pt")
        stages = sorted(path.glob("stage-*-of-*.pt"))
        if not isinstance(meta, dict) or "config" not in meta or not stages:
            raise ExportError(f"{path}: not a pipeline checkpoint directory (meta.pt and stage-*-of-*.pt)")
        try:
            weights = merge_stage_checkpoints([_torch_load(p) for p in stages])
        except CheckpointError as exc:
            raise ExportError(f"{path}: {exc}") from None
        state: Mapping[str, Any] = meta
    else:
        state = _torch_load(path)
        if not isinstance(state, dict) or not isinstance(state.get("model"), Mapping) or "config" not in state:
            raise ExportError(f"{path}: not an hpctrain checkpoint (expected a dict with 'model' and 'config')")
        weights = OrderedDict(state["model"])
    normalize = state.get("normalize", (state.get("extra") or {}).get("normalize"))
    return Loaded(path=path, step=int(state.get("step", -1)), weights=weights, config=dict(state["config"]),
                  normalize=normalize)


# ---------------------------------------------------------------------------- normalisation
def normalization(stats: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(shift, scale)`` with ``(x - shift) / scale`` the normalised input, from ``{mean, std}``
    or ``{min, max}``; None for ``None`` or ``{kind: none}``. A zero scale (a constant
    feature) becomes 1, so such a feature maps to 0 instead of NaN."""
    if stats is None or (isinstance(stats, Mapping) and str(stats.get("kind", stats.get("method", ""))) == "none"):
        return None
    if not isinstance(stats, Mapping):
        raise ExportError(f"checkpoint 'normalize' is a {type(stats).__name__}; expected {{mean, std}} or {{min, max}}")
    if "mean" in stats and "std" in stats:
        shift, scale = torch.as_tensor(stats["mean"]), torch.as_tensor(stats["std"])
    elif "min" in stats and "max" in stats:
        shift = torch.as_tensor(stats["min"])
        scale = torch.as_tensor(stats["max"]) - shift
    else:
        raise ExportError(f"checkpoint 'normalize' has keys {sorted(stats)}; expected mean and std, or min and max")
    shift, scale = shift.to(torch.float32), scale.to(torch.float32)
    return shift, torch.where(scale == 0, torch.ones_like(scale), scale)


class Normalized(nn.Module):
    """``model((x - shift) / scale)``: the training run's input normalisation, then the model.
    Scriptable (one input)."""

    def __init__(self, model: nn.Module, shift: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("shift", shift)
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x - self.shift) / self.scale)


class NormalizedInputs(nn.Module):
    """Several inputs, each with its own ``(shift, scale)`` or none, then ``model(*inputs)``."""

    def __init__(self, model: nn.Module, stats: Sequence[Optional[Tuple[torch.Tensor, torch.Tensor]]]) -> None:
        super().__init__()
        self.model = model
        self.present = [s is not None for s in stats]
        for i, s in enumerate(stats):
            if s is not None:
                self.register_buffer(f"shift{i}", s[0])
                self.register_buffer(f"scale{i}", s[1])

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        xs = [(x - getattr(self, f"shift{i}")) / getattr(self, f"scale{i}") if i < len(self.present) and self.present[i]
              else x for i, x in enumerate(inputs)]
        return self.model(*xs)


def with_normalization(model: nn.Module, stats: Any) -> nn.Module:
    """``model`` wrapped so that it normalises its input(s) as the checkpoint says (or unchanged)."""
    if isinstance(stats, (list, tuple)):
        parts = [normalization(s) for s in stats]
        return NormalizedInputs(model, parts) if any(p is not None for p in parts) else model
    pair = normalization(stats)
    return model if pair is None else Normalized(model, *pair)


# ---------------------------------------------------------------------------- the model
def build_model(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """The config's ``model.factory(**model.kwargs)`` with ``weights`` loaded, in eval mode."""
    from hpctrain.train.config import ConfigError
    from hpctrain.train.trainer import import_factory

    section = config.get("model") or {}
    factory = section.get("factory", "hpctrain.train.models:mlp")
    try:
        model = import_factory(factory)(**dict(section.get("kwargs") or {}))
    except ConfigError as exc:
        raise ExportError(f"cannot rebuild the model: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ExportError(f"model.factory {factory!r} returned {type(model).__name__}, not a torch.nn.Module")
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ExportError(f"the checkpoint's weights do not fit {factory} with kwargs {section.get('kwargs')}: "
                          f"{first}\nHINT: the factory must build the same model as in training") from None
    return model.eval()


def load_model(run_dir: PathLike, best: bool = False, checkpoint: Optional[PathLike] = None) -> nn.Module:
    """The run's trained model in eval mode, on the CPU, with the checkpoint's weights and input
    normalisation (see the module docstring). ``best``: the checkpoint with ``best`` in its
    name; ``checkpoint``: that file (or pipeline directory) instead."""
    loaded = read_checkpoint(checkpoint if checkpoint is not None else find_checkpoint(run_dir, best))
    model = build_model(loaded.config, loaded.weights)
    return with_normalization(model, loaded.normalize).eval()


# ---------------------------------------------------------------------------- export
def sample_input(config: Mapping[str, Any], rows: int = 2) -> torch.Tensor:
    """Zeros shaped like ``rows`` rows of the run's input data (for tracing)."""
    from hpctrain.data.h5files import describe, expand_paths
    from hpctrain.data.loader import _torch_dtype

    data = config.get("data") or {}
    key = (data.get("keys") or {}).get("x", "x")
    if isinstance(key, list):  # several inputs: the tracer's sample is the first
        key = key[0]
    paths = [p for role in ("test", "train") for p in (data.get(role) or [])]
    try:
        info = describe(expand_paths(paths)[0], [key])
    except Exception as exc:
        raise ExportError(f"cannot read the input shape from the run's data {paths}: {exc}") from None
    dtype = _torch_dtype((data.get("dtypes") or {}).get("x", "float32")) or torch.float32
    return torch.zeros((rows, *info.keys[key].shape[1:]), dtype=dtype)


def _sample_or_none(config: Mapping[str, Any]) -> Optional[torch.Tensor]:
    try:
        return sample_input(config)
    except ExportError as exc:
        log.warning("no sample input for tracing: %s", exc)
        return None


def to_torchscript(model: nn.Module, example: Optional[Callable[[], Optional[torch.Tensor]]] = None
                   ) -> torch.jit.ScriptModule:
    """``torch.jit.script(model)``, else ``torch.jit.trace`` with ``example()`` (a sample input,
    asked for only then). A traced model fixes data-dependent control flow to the path the
    example took."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # asked for explicitly; torch.export is the other way
            return torch.jit.script(model)
    except Exception as exc:  # torch.jit raises many types for unsupported Python
        lines = str(exc).strip().splitlines()
        scripted_error = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    sample = example() if example is not None else None
    if sample is None:
        raise ExportError(f"the model cannot be scripted ({scripted_error}) and there is no sample input to trace "
                          "it with\nHINT: use the state_dict with your model class, or hpctrain.load_model(RUN_DIR)")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.trace(model, sample)
    except Exception as exc:
        raise ExportError(f"the model can neither be scripted ({scripted_error}) nor traced "
                          f"({type(exc).__name__}: {exc})\nHINT: use the state_dict with your model class, "
                          "or hpctrain.load_model(RUN_DIR)") from None


def to_exported_program(model: nn.Module, example: torch.Tensor) -> Any:
    """``torch.export.export(model, (example,))`` with the batch dimension dynamic (the
    example needs at least 2 rows: sizes 0 and 1 would be specialised)."""
    try:
        return torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    except Exception as exc:  # unsupported Python in forward, data-dependent control flow
        lines = str(exc).strip().splitlines()
        raise ExportError(f"torch.export cannot capture the model ({type(exc).__name__}: {lines[0] if lines else ''})"
                          "\nHINT: use --torchscript, or the state_dict with your model class") from None


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote."""

    checkpoint: Path
    step: int
    state_dict: Path
    torchscript: Optional[Path]
    program: Optional[Path]       # torch.export's ExportedProgram (.pt2)
    normalize: Optional[Path]     # the input normalisation's tensors, when the run has one


def export(run_dir: PathLike, out: PathLike, *, best: bool = False, checkpoint: Optional[PathLike] = None,
           torchscript: Optional[PathLike] = None, program: Optional[PathLike] = None) -> Exported:
    """Write the model's plain ``state_dict`` (tensors only: loads with ``weights_only=True``)
    to ``out``; with ``torchscript``, also the model with its input normalisation as
    TorchScript (``torch.jit.load``-able without hpctrain or the model's code). A run with
    input normalisation also gets ``<out stem>.normalize.pt`` (``shift``/``scale`` tensors).
    With ``program``, also ``torch.export``'s ExportedProgram (``torch.export.load``; needs the
    run's data for the input shape)."""
    loaded = read_checkpoint(checkpoint if checkpoint is not None else find_checkpoint(run_dir, best))
    model = build_model(loaded.config, loaded.weights)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items()), str(out))
    full = with_normalization(model, loaded.normalize).eval()
    norm_path = None
    if full is not model:
        # The state_dict is the bare model's (it loads into a fresh factory model); the
        # normalisation's tensors go beside it.
        norm_path = out.with_name(out.stem + ".normalize.pt")
        torch.save({k: v.clone() for k, v in full.state_dict().items() if not k.startswith("model.")},
                   str(norm_path))
    ts_path = None if torchscript is None else Path(torchscript)
    if ts_path is not None:
        ts_path.parent.mkdir(parents=True, exist_ok=True)
        to_torchscript(full, lambda: _sample_or_none(loaded.config)).save(str(ts_path))
    program_path = None if program is None else Path(program)
    if program_path is not None:
        program_path.parent.mkdir(parents=True, exist_ok=True)
        torch.export.save(to_exported_program(full, sample_input(loaded.config)), str(program_path))
    return Exported(checkpoint=loaded.path, step=loaded.step, state_dict=out, torchscript=ts_path,
                    program=program_path, normalize=norm_path)
