"""Checks that turn a user's mistake into one error with a HINT before the first step,
instead of a traceback mid-run or a silently wrong run: model factory arguments, the data's
sample width against the model's input, the labels against the model's classes, and a
checkpoint against the model it is loaded into.

The checks are pure functions of their arguments (no MPI, no file I/O) and raise
:class:`ConfigError` / :class:`CheckpointError`, which ``hpctrain train`` prints as one error
and exit code 2. :func:`check_data_fits_model` reads the labels through ``hpctrain.data`` and
takes the cross-rank gather as an argument, so every rank reaches the same decision from
the same gathered numbers (no rank raises alone while the others wait in a collective).
"""
from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from hpctrain.train.checkpoint import CheckpointError
from hpctrain.train.config import ConfigError

#: factory parameter names that set the model's input width / class count (for hints)
WIDTH_PARAMS = ("in_features", "input_dim", "in_dim", "input_size", "in_channels", "side")
CLASS_PARAMS = ("num_classes", "n_classes", "classes", "out_features", "output_dim")


# --------------------------------------------------------------------------- factory
def signature_text(fn: Callable[..., Any]) -> str:
    """``name=default, …`` of ``fn``'s parameters ('?' when not introspectable)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return "?"
    shown = []
    for p in params:
        name = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        shown.append(name if p.default is p.empty else f"{name}={p.default!r}")
    return ", ".join(shown)


def callable_hint(module: Any, name: str) -> str:
    """``"\nHINT: …"`` for a factory name missing from ``module``: the close matches among
    its public callables, else a few of them."""
    found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                   and getattr(v, "__module__", None) == module.__name__)  # defined there, not imported
    close = difflib.get_close_matches(name, found, n=3)
    if close:
        return f"\nHINT: did you mean {', '.join(repr(c) for c in close)}?"
    return f"\nHINT: its callables: {_few(found, 8) or '(none)'}"


def kwargs_error(fn: Callable[..., Any], spec: str, kwargs: Mapping[str, Any]) -> Optional[str]:
    """Why ``fn(**kwargs)`` cannot bind (unknown or missing parameters), or None."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin or C callable: nothing to check before calling it
    params = sig.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in named] if not takes_any else []
    accepted = f"it takes ({signature_text(fn)})"
    if unknown:
        close = [m for k in unknown for m in difflib.get_close_matches(k, named, n=1)]
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else "use the parameters listed"
        return (f"model.kwargs: {', '.join(repr(k) for k in unknown)} not accepted by model.factory {spec!r}; "
                f"{accepted}\nHINT: {hint}")
    try:
        sig.bind(**kwargs)
    except TypeError as exc:
        return (f"model.kwargs do not fit model.factory {spec!r}: {exc}; {accepted}\n"
                "HINT: add the missing parameters under model.kwargs")
    return None


def build_model(fn: Callable[..., Any], spec: str, kwargs: Mapping[str, Any]) -> Any:
    """``fn(**kwargs)``; a bad parameter name, or a value the factory rejects with
    TypeError/ValueError, is a ConfigError naming the factory and its parameters."""
    problem = kwargs_error(fn, spec, kwargs)
    if problem:
        raise ConfigError(problem)
    try:
        return fn(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.factory {spec!r} rejected model.kwargs {dict(kwargs)}: "
                          f"{type(exc).__name__}: {exc}; it takes ({signature_text(fn)})\n"
                          "HINT: check the values of model.kwargs against the factory's parameters") from exc


# --------------------------------------------------------------------------- input width
def first_layer(model: torch.nn.Module) -> Optional[Tuple[str, str, int]]:
    """(layer name, attribute, value) of the first layer that fixes the input width."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            return name, "in_features", int(m.in_features)
        if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            return name, "in_channels", int(m.in_channels)
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            return None
    return None


def width_message(model: torch.nn.Module, spec: str, key: str, sample_shape: Sequence[int],
                  error: BaseException, factory_params: Sequence[str] = ()) -> str:
    """The one error for data samples the model cannot take."""
    features = 1
    for s in sample_shape:
        features *= int(s)
    layer = first_layer(model)
    expects = (f"its first layer {layer[0]!r} expects {layer[1]}={layer[2]}" if layer
               else "it cannot take them")
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    settable = [p for p in WIDTH_PARAMS if p in factory_params]
    hint = (f"set model.kwargs.{settable[0]} to match the data ({features} features per sample)" if settable
            else "make the model's input match the data, or point data.keys.x at the right dataset")
    return (f"the data's samples (key {key!r}, shape {tuple(int(s) for s in sample_shape)} = {features} "
            f"features) do not fit the model of {spec!r}: {expects} ({cause})\nHINT: {hint}")


def probe_model(model: torch.nn.Module, spec: str, key: str, sample_shape: Sequence[int], dtype: torch.dtype,
                factory_params: Sequence[str] = ()) -> torch.Tensor:
    """The model's output for two all-zero samples shaped like the data (eval mode, no
    gradient: no running statistics or RNG streams change); a model that cannot take the
    data's samples is a ConfigError saying both widths."""
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    x = torch.zeros((2, *[int(s) for s in sample_shape]), dtype=dtype, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(x)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise ConfigError(width_message(model, spec, key, sample_shape, exc, factory_params)) from exc
    finally:
        model.train(was_training)


# --------------------------------------------------------------------------- labels
def label_error(summary: Any, num_classes: int, key: str, factory_params: Sequence[str] = ()) -> Optional[str]:
    """Why labels (a ``hpctrain.data.labels.LabelSummary``) do not suit a classifier with
    ``num_classes`` outputs, or None."""
    if summary.fractional:
        path, row, value = summary.example
        return (f"labels (key {key!r}) hold {summary.fractional} value(s) that are not class indices, e.g. "
                f"{value!r} at row {row} of {path}; loss cross_entropy would truncate them to integers\n"
                "HINT: store whole-number class indices 0..N-1 (integers), or set loss: mse for "
                "real-valued targets")
    if summary.count == 0 or summary.low is None:
        return None
    low, high = int(summary.low), int(summary.high)
    if low >= 0 and high < num_classes:
        return None
    value, (path, row) = (low, summary.low_at) if low < 0 else (high, summary.high_at)
    settable = [p for p in CLASS_PARAMS if p in factory_params]
    if low < 0:
        hint = "class indices start at 0: relabel the data to 0..N-1"
    elif settable:
        hint = f"set model.kwargs.{settable[0]}: {high + 1} (labels 0..{high}), or relabel the data"
    else:
        hint = f"give the model {high + 1} outputs (labels 0..{high}), or relabel the data"
    return (f"labels (key {key!r}) range from {low} to {high} but the model has {num_classes} outputs "
            f"(classes 0..{num_classes - 1}): label {value} at row {row} of {path}\nHINT: {hint}")


# --------------------------------------------------------------------------- checkpoints
def _few(items: List[str], limit: int) -> str:
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def state_dict_mismatch(expected: Mapping[str, Any], found: Mapping[str, Any], limit: int = 3) -> Optional[str]:
    """Keys a checkpoint's ``found`` state lacks, adds, or holds with another shape than the
    model's ``expected`` one (a few of each), or None when they match."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    shapes = [f"{k} {tuple(found[k].shape)} vs {tuple(expected[k].shape)}" for k in expected
              if k in found and hasattr(found[k], "shape") and hasattr(expected[k], "shape")
              and tuple(found[k].shape) != tuple(expected[k].shape)]
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {_few(missing, limit)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: {_few(unexpected, limit)}")
    if shapes:
        parts.append(f"shape differs for {len(shapes)} (checkpoint vs model): {_few(shapes, limit)}")
    return "; ".join(parts) or None


def load_model_state(model: torch.nn.Module, state: Mapping[str, Any], path: Any,
                     written_by: Optional[Mapping[str, Any]] = None) -> None:
    """``model.load_state_dict(state)``, or a CheckpointError listing the mismatched keys."""
    problem = state_dict_mismatch(model.state_dict(), state)
    if problem:
        by = ""
        if written_by:
            by = f" (it was written by model.factory {written_by.get('factory')!r} with kwargs " \
                 f"{written_by.get('kwargs', {})})"
        raise CheckpointError(f"checkpoint {path} does not fit this model{by}: {problem}\n"
                              "HINT: resume with the model.factory and model.kwargs of the run that wrote it, "
                              "or start fresh with a new run_dir (or checkpoint.dir)")
    model.load_state_dict(state)


# --------------------------------------------------------------------------- the model against the data
def check_data_fits_model(cfg: Any, model: torch.nn.Module, factory: Callable[..., Any], part: int = 0,
                          parts: int = 1, gather: Callable[[Any], List[Any]] = lambda x: [x]) -> None:
    """Probe ``model`` (built by ``factory``) with the data's sample shape and, for cross_entropy, check the labels
    of every train and test file against its output width. Each of ``parts`` ranks reads
    its ``part`` of the labels; ``gather`` (e.g. ``comm.allgather_object``, called on every
    rank) combines them, so every rank raises the same error or none."""
    from hpctrain.data.errors import DataError
    from hpctrain.data.h5files import describe, expand_paths
    from hpctrain.data.labels import label_summary, merge
    from hpctrain.data.loader import _torch_dtype

    x = cfg.data.keys["x"]
    if not isinstance(x, str):
        return  # several inputs: the model's own forward says what it takes (no single width)
    xk, yk = x, cfg.data.keys["y"]
    info = describe(expand_paths(list(cfg.data.train))[0], [xk]).keys[xk]
    dtype = _torch_dtype(cfg.data.dtypes.get("x") or info.dtype) or torch.float32
    try:
        factory_params = list(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        factory_params = []
    out = probe_model(model, cfg.model.factory, xk, info.shape[1:], dtype, factory_params)
    from hpctrain.train.losses import parse_loss

    classify = parse_loss(cfg.loss).classification
    if classify is None:  # a user loss: classification when the labels are integers
        from hpctrain.train.task import label_kind

        classify = label_kind(cfg)
    if not classify or out.ndim < 2:
        return
    paths = expand_paths(list(cfg.data.train)) + (expand_paths(list(cfg.data.test)) if cfg.data.test else [])
    try:
        mine: Any = label_summary(paths, yk, part, parts)
    except DataError as exc:
        mine = str(exc)
    found = gather(mine)
    errors = [f for f in found if isinstance(f, str)]
    if errors:
        raise DataError(errors[0])
    problem = label_error(merge(found), int(out.shape[1]), yk, factory_params)
    if problem:
        raise ConfigError(problem)


# --------------------------------------------------------------------------- optional packages
def check_optional_packages(cfg: Any) -> None:
    """Import every optional package the config switches on (today: ``tensorboard: true``),
    so a missing one fails the dry run rather than the run."""
    if cfg.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"tensorboard: true needs the tensorboard package ({exc})\n"
                              "HINT: pip install tensorboard, or set tensorboard: false") from exc
