"""The training loss named by a config's ``loss:`` key.

``loss:`` is a built-in name, a built-in name with options, or a user function::

    loss: cross_entropy
    loss: {name: cross_entropy, label_smoothing: 0.1, class_weights: [1, 2, 1]}
    loss: {name: huber, delta: 0.5}
    loss: losses.py:focal          # file relative to the config's folder, or pkg.module:fn

Every loss is returned per sample (shape ``[batch]``) so that the runner can ignore padding
samples and average exactly over every rank's real samples. A user function takes
``(output, target)`` and may return per-sample values or one number (taken as the batch
mean, so each sample counts it once).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Union

import torch
import torch.nn.functional as F

__all__ = ["BUILTIN_LOSSES", "LossSpec", "parse_loss", "build_loss", "LossError"]

#: name -> (options it takes, is it a classification loss with integer targets)
BUILTIN_LOSSES: Dict[str, tuple] = {
    "cross_entropy": (("label_smoothing", "class_weights"), True),
    "mse": ((), False),
    "bce_with_logits": (("pos_weight",), False),
    "huber": (("delta",), False),
}


class LossError(ValueError):
    """A bad ``loss:`` value; the message names it and says what is accepted."""


@dataclass(frozen=True)
class LossSpec:
    """A parsed ``loss:``: a built-in ``name`` with ``options``, or a user ``function`` spec."""

    name: str = "cross_entropy"
    options: Dict[str, Any] = field(default_factory=dict)
    function: str = ""           # "file.py:fn" or "pkg.mod:fn" (name is then "user")

    @property
    def classification(self) -> Optional[bool]:
        """Integer class targets (accuracy, F1, ... apply); None for a user function (the
        runner decides from the label dtype of the data)."""
        if self.function:
            return None
        return BUILTIN_LOSSES[self.name][1]

    def to_config(self) -> Union[str, Dict[str, Any]]:
        if self.function:
            return self.function
        return {"name": self.name, **self.options} if self.options else self.name


def parse_loss(value: Union[str, Mapping[str, Any]]) -> LossSpec:
    """Check ``loss:`` without importing anything (the config stays plain data)."""
    if isinstance(value, str):
        if ":" in value:
            return LossSpec(name="user", function=_check_function_spec(value))
        value = {"name": value}
    if not isinstance(value, Mapping) or "name" not in value:
        raise LossError(f"loss: {value!r}; expected a name ({', '.join(BUILTIN_LOSSES)}), "
                        "{name: ..., options...} or 'file.py:function'")
    name = value["name"]
    if name not in BUILTIN_LOSSES:
        raise LossError(f"loss: {name!r} is not one of {', '.join(map(repr, BUILTIN_LOSSES))}\n"
                        "HINT: or give your own function as 'losses.py:my_loss' taking (output, target)")
    options = {k: v for k, v in value.items() if k != "name"}
    allowed = BUILTIN_LOSSES[name][0]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise LossError(f"loss: {name} takes no option {', '.join(unknown)}; "
                        f"its options: {', '.join(allowed) or 'none'}")
    _check_options(name, options)
    return LossSpec(name=name, options=options)


def _check_function_spec(spec: str) -> str:
    mod, _, fn = spec.rpartition(":")
    if not (mod and fn.isidentifier()):
        raise LossError(f"loss: {spec!r} is not 'file.py:function' or 'package.module:function'")
    return spec


def _check_options(name: str, options: Mapping[str, Any]) -> None:
    ls = options.get("label_smoothing", 0.0)
    if not (isinstance(ls, (int, float)) and 0.0 <= ls < 1.0):
        raise LossError(f"loss.label_smoothing: {ls!r}; expected a number in [0, 1)")
    weights = options.get("class_weights")
    if weights is not None and (not isinstance(weights, (list, tuple)) or not weights
                                or any(not isinstance(w, (int, float)) or w < 0 for w in weights)):
        raise LossError(f"loss.class_weights: {weights!r}; expected one non-negative number per class")
    delta = options.get("delta", 1.0)
    if not (isinstance(delta, (int, float)) and delta > 0):
        raise LossError(f"loss.delta: {delta!r}; expected a number > 0")
    pos = options.get("pos_weight")
    if pos is not None and not (isinstance(pos, (int, float)) and pos > 0):
        raise LossError(f"loss.pos_weight: {pos!r}; expected a number > 0")


PerSampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_loss(spec: LossSpec, importer: Optional[Callable[[str], Callable[..., Any]]] = None) -> PerSampleLoss:
    """The per-sample loss function. ``importer`` resolves a user function spec (the runner
    passes its config-relative importer)."""
    if spec.function:
        if importer is None:
            raise LossError(f"loss: {spec.function!r} needs an importer")
        return _user_loss(spec.function, importer(spec.function))
    return _BUILDERS[spec.name](spec.options)


def _cross_entropy(options: Mapping[str, Any]) -> PerSampleLoss:
    smoothing = float(options.get("label_smoothing", 0.0))
    weights = options.get("class_weights")

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = None
        if weights is not None:
            if len(weights) != out.shape[1]:
                raise LossError(f"loss.class_weights has {len(weights)} values but the model outputs "
                                f"{out.shape[1]} classes\nHINT: give one weight per class")
            w = torch.as_tensor(weights, dtype=out.dtype, device=out.device)
        return F.cross_entropy(out, y.long(), weight=w, reduction="none", label_smoothing=smoothing)
    return loss


def _per_row(values: torch.Tensor) -> torch.Tensor:
    return values.reshape(values.shape[0], -1).mean(dim=1)


def _aligned(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if y.numel() != out.numel():
        raise LossError(f"the target has {y.numel() // max(1, y.shape[0])} values per sample but the model "
                        f"outputs {out.numel() // max(1, out.shape[0])}\nHINT: regression losses need one "
                        "model output per target value")
    return y.to(out.dtype).reshape(out.shape)


def _mse(options: Mapping[str, Any]) -> PerSampleLoss:
    return lambda out, y: _per_row((out - _aligned(out, y)) ** 2)


def _huber(options: Mapping[str, Any]) -> PerSampleLoss:
    delta = float(options.get("delta", 1.0))
    return lambda out, y: _per_row(F.huber_loss(out, _aligned(out, y), reduction="none", delta=delta))


def _bce(options: Mapping[str, Any]) -> PerSampleLoss:
    pos = options.get("pos_weight")

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pw = None if pos is None else torch.tensor(float(pos), dtype=out.dtype, device=out.device)
        return _per_row(F.binary_cross_entropy_with_logits(out, _aligned(out, y), reduction="none",
                                                           pos_weight=pw))
    return loss


_BUILDERS = {"cross_entropy": _cross_entropy, "mse": _mse, "bce_with_logits": _bce, "huber": _huber}


def _user_loss(spec: str, fn: Callable[..., Any]) -> PerSampleLoss:
    try:
        inspect.signature(fn).bind(None, None)
    except (TypeError, ValueError) as exc:
        raise LossError(f"loss: {spec} must take (output, target): {exc}") from None

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        value = fn(out, y)
        if not isinstance(value, torch.Tensor):
            raise LossError(f"loss: {spec} returned {type(value).__name__}; expected a tensor")
        if value.dim() == 0:
            return value.expand(out.shape[0])      # a batch mean: each sample carries it once
        if value.shape[0] != out.shape[0] or value.dim() != 1:
            raise LossError(f"loss: {spec} returned shape {tuple(value.shape)}; expected a number or one "
                            f"value per sample ({out.shape[0]},)")
        return value
    return loss


def user_function_path(spec: str, base: Path) -> str:
    """``file.py:fn`` made relative to ``base`` (the config's folder); module specs unchanged."""
    mod, _, fn = spec.rpartition(":")
    if mod.endswith(".py") and not Path(mod).is_absolute():
        return f"{base / mod}:{fn}"
    return spec
