"""Typed, validated training configuration: dataclasses, a YAML loader and ``--set`` overrides.

Precedence: defaults < YAML file < ``--set key=value`` (dotted keys, e.g.
``--set optimizer.lr=0.05``) — nothing hidden. Unknown keys are an error that lists the
valid ones (a typo never silently falls back to a default). Runtime objects (communicator,
model, device) are never stored here; :class:`TrainConfig` is plain data that round-trips
through :meth:`TrainConfig.to_dict` / :func:`config_from_dict` (checkpoints store it).

Every key is documented in docs/train.md.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = [
    "ConfigError", "ModelConfig", "DataConfig", "OptimizerConfig", "ScheduleConfig", "SyncConfig",
    "EvalConfig", "CheckpointConfig", "DebugConfig", "ElasticConfig", "TrainConfig", "load_config", "config_from_dict",
    "apply_overrides", "parse_override", "valid_keys",
]

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "step")
LR_SCALING = ("linear", "sqrt", "none")
STRATEGIES = ("allreduce", "parameter_server", "model_average")
COMPRESSIONS = ("none", "fp16", "bf16")
BACKENDS = ("mpi", "gloo", "nccl", "horovod")
POLICIES = ("contiguous", "strided", "weighted", "stratified")
BUFFERS = ("average", "broadcast", "none")
PRECISIONS = ("fp32", "bf16", "fp16")
NORMALIZE = ("none", "standard", "minmax")
ON_NAN = ("stop", "skip")
BALANCE = ("off", "auto")
DICT_KEYS = ("model.kwargs", "data.keys", "data.dtypes", "parallel", "early_stopping", "loss")


class ConfigError(ValueError):
    """A bad configuration value or key; the message says what was seen, expected, and the fix."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _choice(name: str, value: str, choices: Sequence[str]) -> None:
    _need(value in choices, f"{name}: {value!r} is not one of {', '.join(map(repr, choices))}")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """``factory``: ``"package.module:function"`` or ``"path/to/file.py:function"``; called with
    ``kwargs`` and must return a ``torch.nn.Module``."""

    factory: str = "hpctrain.train.models:mlp"
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        mod, sep, fn = self.factory.rpartition(":")
        _need(bool(sep and mod and fn and fn.isidentifier()),
              f"model.factory: {self.factory!r} is not 'module:function' "
              "(e.g. 'hpctrain.train.models:mlp' or 'examples/models.py:cnn')")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """HDF5 inputs. Paths may be files, directories or globs; relative paths are taken from
    the directory of the YAML file."""

    train: List[str] = field(default_factory=list)
    test: List[str] = field(default_factory=list)
    # Empty: the roles `hpctrain data pack` recorded in the first training file, else x and y
    # (filled in by resolve_keys before training).
    keys: Dict[str, Union[str, List[str]]] = field(default_factory=dict)
    dtypes: Dict[str, str] = field(default_factory=lambda: {"x": "float32", "y": "int64"})
    policy: str = "contiguous"
    shuffle: bool = True
    drop_last: bool = True
    prefetch: int = 1
    weights: List[float] = field(default_factory=list)
    stratify: str = ""           # policy stratified: the integer class key (default: data.keys.y)
    normalize: str = "none"      # standard | minmax: statistics over all ranks' training inputs

    def __post_init__(self) -> None:
        _need(bool(self.train), "data.train: no training files given; expected a list of HDF5 paths, "
              "e.g. data: {train: [shards/]}")
        _need(set(self.dtypes) <= {"x", "y"}, f"data.dtypes: roles must be 'x'/'y', got {sorted(self.dtypes)}")
        _choice("data.policy", self.policy, POLICIES)
        _choice("data.normalize", self.normalize, NORMALIZE)
        if self.keys:
            self._check_keys()
        _need(self.prefetch >= 0, f"data.prefetch: {self.prefetch} < 0; expected windows to read ahead (>= 0)")
        for i, w in enumerate(self.weights):
            _need(math.isfinite(w) and w > 0, f"data.weights[{i}]: {w} must be a positive number "
                  "(a rank's or node's relative share of the data)")
        if self.policy == "weighted":
            _need(bool(self.weights), "data.policy: weighted needs data.weights: one positive number per rank "
                  "or per node (e.g. weights: [3, 1]).\nHINT: add data.weights, or use policy: contiguous "
                  "(with balance: auto to re-weight from measured speed)")
        else:
            _need(not self.weights, f"data.weights is used only by data.policy: weighted, not {self.policy!r}\n"
                  "HINT: set data.policy: weighted, or remove data.weights")
        _need(not self.stratify or self.policy == "stratified",
              f"data.stratify is used only by data.policy: stratified, not {self.policy!r}\n"
              "HINT: set data.policy: stratified, or remove data.stratify")

    def _check_keys(self) -> None:
        _need(set(self.keys) == {"x", "y"}, f"data.keys: expected exactly the roles 'x' and 'y' "
              f"(mapping to dataset names), got {sorted(self.keys)}")
        _need(isinstance(self.keys["y"], str), f"data.keys.y: {self.keys['y']!r}; expected one dataset name")
        _need(bool(self.x_keys) and all(isinstance(k, str) and k for k in self.x_keys),
              f"data.keys.x: {self.keys['x']!r}; expected a dataset name or a list of them "
              "(the model's forward takes them in that order)")
        _need(self.normalize == "none" or len(self.x_keys) == 1,
              "data.normalize applies to one input, data.keys.x names several\nHINT: normalise in your model's "
              "forward, or set data.normalize: none")

    def resolve_keys(self, recorded: Mapping[str, str]) -> None:
        """Fill in ``keys`` when the config names none: the roles ``recorded`` in the training
        data (``hpctrain.data.roles`` of its first file), a role not recorded by its own name."""
        if self.keys:
            return
        self.keys = {"x": str(recorded.get("x", "x")), "y": str(recorded.get("y", "y"))}
        self._check_keys()

    @property
    def x_keys(self) -> List[str]:
        """The input datasets, in the order the model's forward takes them (``x`` while
        ``keys`` is not resolved yet)."""
        x = self.keys.get("x", "x")
        return [x] if isinstance(x, str) else list(x)

    @property
    def x_key(self) -> str:
        """The first input (its shape sizes a built-in model and the width check)."""
        return self.x_keys[0]


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """``lr`` is the single-rank learning rate; ``lr_scaling`` (top level) scales it."""

    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _choice("optimizer.name", self.name, OPTIMIZERS)
        _need(self.lr > 0 and math.isfinite(self.lr), f"optimizer.lr: {self.lr} must be a positive number")
        _need(0 <= self.momentum < 1, f"optimizer.momentum: {self.momentum} must be in [0, 1)")
        _need(self.weight_decay >= 0, f"optimizer.weight_decay: {self.weight_decay} must be >= 0")
        _need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
              f"optimizer.betas: {self.betas} must be two numbers in [0, 1)")
        _need(not self.nesterov or (self.name == "sgd" and self.momentum > 0),
              "optimizer.nesterov: needs name: sgd and momentum > 0")


@dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    """Learning-rate schedule per optimizer step: linear warm-up over ``warmup_steps``, then
    ``constant``, ``cosine`` (down to ``min_factor`` x lr at the last step) or ``step``
    (multiply by ``gamma`` every ``step_size`` steps)."""

    kind: str = "constant"
    warmup_steps: int = 0
    min_factor: float = 0.0
    step_size: int = 1000
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _choice("schedule.kind", self.kind, SCHEDULES)
        _need(self.warmup_steps >= 0, f"schedule.warmup_steps: {self.warmup_steps} < 0")
        _need(0 <= self.min_factor <= 1, f"schedule.min_factor: {self.min_factor} must be in [0, 1]")
        _need(self.step_size >= 1, f"schedule.step_size: {self.step_size} must be >= 1")
        _need(0 < self.gamma <= 1, f"schedule.gamma: {self.gamma} must be in (0, 1]")


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    """How ranks agree (hpctrain.torch.DistributedOptimizer)."""

    strategy: str = "allreduce"
    compression: str = "none"
    backward_passes_per_step: int = 1
    average_every: int = 1
    server_rank: int = 0
    backend: str = "mpi"
    fusion_threshold: Optional[int] = None
    buffers: str = "average"

    def __post_init__(self) -> None:
        _choice("sync.strategy", self.strategy, STRATEGIES)
        _choice("sync.buffers", self.buffers, BUFFERS)
        _choice("sync.compression", self.compression, COMPRESSIONS)
        _choice("sync.backend", self.backend, BACKENDS)
        _need(self.backward_passes_per_step >= 1,
              f"sync.backward_passes_per_step: {self.backward_passes_per_step} must be >= 1")
        _need(self.average_every >= 1, f"sync.average_every: {self.average_every} must be >= 1")
        _need(self.server_rank >= 0, f"sync.server_rank: {self.server_rank} must be >= 0")
        _need(self.fusion_threshold is None or self.fusion_threshold >= 0,
              f"sync.fusion_threshold: {self.fusion_threshold} must be >= 0 bytes")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Evaluation on ``data.test`` every ``interval_steps`` optimizer steps (0: at the end of
    every epoch) and at the end. Padding samples are ignored; metrics are exact."""

    interval_steps: int = 0
    metrics: List[str] = field(default_factory=lambda: ["accuracy", "loss"])
    batch_size: int = 256

    def __post_init__(self) -> None:
        _need(self.interval_steps >= 0, f"eval.interval_steps: {self.interval_steps} < 0")
        _need(self.batch_size >= 1, f"eval.batch_size: {self.batch_size} must be >= 1")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """``dir`` (default ``<run_dir>/checkpoints``; must be on a file system every rank sees),
    a checkpoint every ``interval_steps`` steps (0: at every epoch end) and at the end; the
    newest ``keep`` are kept."""

    dir: str = ""
    interval_steps: int = 0
    keep: int = 3
    enabled: bool = True
    keep_best: str = ""          # an eval metric: also keep the best checkpoint by it (ckpt-best.pt)

    def __post_init__(self) -> None:
        _need(self.interval_steps >= 0, f"checkpoint.interval_steps: {self.interval_steps} < 0")
        _need(self.keep >= 1, f"checkpoint.keep: {self.keep} must be >= 1 (the last good checkpoint is kept)")


@dataclass(kw_only=True, slots=True)
class DebugConfig:
    """Fault injection and test hooks (off by default)."""

    fail_at_step: int = -1       # raise on rank fail_rank before this step (0-based)
    fail_rank: int = 0
    nan_at_step: int = -1        # make the loss NaN on rank nan_rank at this step
    nan_rank: int = 0
    stop_at_step: int = -1       # checkpoint and stop after this many steps (as a preemption would)
    slow_rank: int = -1          # sleep slow_ms in every step on this rank (straggler tests)
    slow_ms: float = 0.0
    kill_at_step: int = -1       # SIGKILL rank kill_rank in this step, after backward (elastic tests; once)
    kill_rank: int = 0


@dataclass(kw_only=True, slots=True)
class ElasticConfig:
    """Go on when ranks die (docs/elastic.md): with ``min_ranks`` >= 1, a run started with
    ``hpctrain launch --elastic`` re-forms on the survivors, resumes from its last checkpoint
    with the data planned over them, and ends when fewer than ``min_ranks`` are left. 0: off."""

    min_ranks: int = 0

    def __post_init__(self) -> None:
        _need(self.min_ranks >= 0, f"elastic.min_ranks: {self.min_ranks} < 0 (0: elastic mode off)")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The whole run. ``epochs`` or ``steps`` (optimizer steps) sets the length; with both,
    the first reached ends training."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    batch_size: Union[int, str] = 32
    lr_scaling: str = "linear"
    loss: Union[str, Dict[str, Any]] = "cross_entropy"
    precision: str = "fp32"
    clip_grad_norm: float = 0.0
    clip_grad_value: float = 0.0
    early_stopping: Dict[str, Any] = field(default_factory=dict)
    monitor_interval: float = 1.0
    epochs: int = 0
    steps: int = 0
    seed: int = 0
    run_dir: str = "runs/train"
    quiet: bool = False
    log_interval: int = 10
    balance: str = "off"
    straggler_threshold: float = 0.2
    straggler_patience: int = 3
    on_nan: str = "stop"
    timeline: bool = True
    timeline_max_steps: int = 200
    tensorboard: bool = False
    preemption: bool = True
    deterministic: bool = True
    threads: int = 0
    device: str = "auto"
    parallel: Dict[str, Any] = field(default_factory=dict)
    callbacks: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, str):
            _need(self.batch_size == "auto", f"batch_size: {self.batch_size!r}; expected a positive integer or 'auto'")
        else:
            _need(self.batch_size >= 1, f"batch_size: {self.batch_size}; expected a positive integer or 'auto'")
        _choice("lr_scaling", self.lr_scaling, LR_SCALING)
        _choice("precision", self.precision, PRECISIONS)
        _need(self.clip_grad_norm >= 0 and self.clip_grad_value >= 0,
              "clip_grad_norm / clip_grad_value must be >= 0 (0: no clipping)")
        _need(self.monitor_interval >= 0, f"monitor_interval: {self.monitor_interval} < 0 (seconds; 0: off)")
        self._check_loss_and_metrics()
        _choice("balance", self.balance, BALANCE)
        _choice("on_nan", self.on_nan, ON_NAN)
        _need(self.device in ("auto", "cpu", "cuda"), f"device: {self.device!r} is not one of 'auto', 'cpu', 'cuda'")
        _need(self.epochs >= 0 and self.steps >= 0, "epochs and steps must be >= 0")
        _need(self.epochs > 0 or self.steps > 0,
              "neither epochs nor steps is set; expected e.g. epochs: 10 or steps: 1000")
        _need(self.log_interval >= 1, f"log_interval: {self.log_interval} must be >= 1")
        _need(self.straggler_threshold > 0, f"straggler_threshold: {self.straggler_threshold} must be > 0 "
              "(0.2 = warn when a rank is 20% slower than the median)")
        _need(self.straggler_patience >= 1, f"straggler_patience: {self.straggler_patience} must be >= 1")
        _need(self.timeline_max_steps >= 0, f"timeline_max_steps: {self.timeline_max_steps} < 0")
        _need(self.threads >= 0, f"threads: {self.threads} < 0")
        _need(bool(self.run_dir), "run_dir is empty; expected a directory for metrics, plots and checkpoints")
        if self.balance == "auto":
            _need(self.data.policy in ("contiguous", "weighted"),
                  f"balance: auto re-weights the contiguous partition; data.policy {self.data.policy!r} "
                  "cannot be re-weighted. HINT: use data.policy: contiguous")
        _need(not (self.parallel and self.elastic.min_ranks),
              "elastic.min_ranks with parallel (pipeline stages): a lost rank would take a stage with it; "
              "HINT: elastic mode is for data-parallel runs")
        if self.parallel:
            from hpctrain.parallel.config import ParallelConfig

            try:
                pc = ParallelConfig.from_dict(self.parallel)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            from hpctrain.train.pipeline import check_runner_options

            check_runner_options(self, pc)
        for i, spec in enumerate(self.callbacks):
            mod, sep, name = spec.rpartition(":")
            _need(bool(sep and mod and name.isidentifier()),
                  f"callbacks[{i}]: {spec!r} is not 'file.py:Class' or 'package.module:Class'")

    def _check_loss_and_metrics(self) -> None:
        """``loss``, ``eval.metrics``, ``early_stopping`` and ``checkpoint.keep_best`` agree."""
        from hpctrain.train.losses import LossError, parse_loss
        from hpctrain.train.scoring import MetricError, parse_metrics
        from hpctrain.train.stopping import Improvement, StoppingError

        try:
            spec = parse_loss(self.loss)
            metrics = parse_metrics(self.eval.metrics, spec.classification)
            watched = [m for m in (self.early_stopping.get("metric"), self.checkpoint.keep_best) if m]
            if self.early_stopping:
                unknown = sorted(set(self.early_stopping) - {"metric", "mode", "patience", "min_delta"})
                _need(not unknown, f"early_stopping: unknown key(s) {', '.join(unknown)}; "
                      "valid keys: metric, mode, patience, min_delta")
                _need("metric" in self.early_stopping, "early_stopping: needs metric, e.g. {metric: f1, patience: 5}")
                Improvement(**{k: v for k, v in self.early_stopping.items()})
        except (LossError, MetricError, StoppingError, TypeError) as exc:
            raise ConfigError(str(exc)) from None
        names = {m.key[5:] for m in metrics}
        for m in watched:
            _need(m in names, f"{m!r} is watched (early_stopping / checkpoint.keep_best) but not computed\n"
                  f"HINT: add {m} to eval.metrics (now: {', '.join(self.eval.metrics)})")
        _need(not watched or bool(self.data.test),
              "early_stopping / checkpoint.keep_best need evaluations\nHINT: give data.test files")

    # -- derived -------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path(self.run_dir) / "checkpoints")

    def to_dict(self) -> Dict[str, Any]:
        """Plain data (dicts, lists, numbers, strings): YAML/JSON/checkpoint friendly."""
        return _to_plain(self)


# ---------------------------------------------------------------------------- building
def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return obj


def valid_keys(cls: type = None, prefix: str = "") -> List[str]:
    """Every dotted key a config accepts (for error messages and docs)."""
    cls = cls or TrainConfig
    out: List[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out.extend(valid_keys(t, prefix + f.name + "."))
        else:
            out.append(prefix + f.name)
    return out


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def _coerce(value: Any, t: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``t`` (int/float/bool/str, List, Dict, Optional, Union)."""
    origin = typing.get_origin(t)
    if t is Any:
        return value
    if origin is Union:
        args = typing.get_args(t)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: {value!r} is not a valid " + " or ".join(
            _type_name(a) for a in args if a is not type(None)))
    if origin in (list, List):
        (inner,) = typing.get_args(t) or (Any,)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and inner is str:
            value = [value]  # a single path is a one-element list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Dict):
        kt, vt = typing.get_args(t) or (str, Any)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {_coerce(k, kt, where): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if t is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if t is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "1e-3" as a string
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if t is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported type {t!r}")  # pragma: no cover - internal


def _build(cls: type, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        import difflib

        here = (where + ".") if where else ""
        close = [f"{m[0]!r} for {k!r}" for k in unknown for m in [difflib.get_close_matches(str(k), names, n=1)] if m]
        hint = ("did you mean " + ", ".join(close) if close else "remove it, or see docs/train.md for the keys")
        raise ConfigError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(repr(here + str(k)) for k in unknown)}; "
            f"valid keys{' of ' + where if where else ''}: {', '.join(names)}\nHINT: {hint}")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        t = hints[name]
        key = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(t):
            kwargs[name] = _build(t, data[name], key)
        else:
            kwargs[name] = _coerce(data[name], t, key)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in kwargs and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]  # type: ignore[misc]
        if missing:
            raise ConfigError(f"{where or 'config'}: missing required key(s) {', '.join(missing)}") from exc
        raise


def config_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """Build and validate a :class:`TrainConfig` from plain data (e.g. parsed YAML)."""
    return _build(TrainConfig, data, "")


def parse_override(text: str) -> Tuple[List[str], Any]:
    """``"optimizer.lr=0.05"`` -> (["optimizer", "lr"], 0.05). The value is parsed as YAML."""
    import yaml

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set optimizer.lr=0.05")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """Apply ``--set`` overrides to the raw config mapping (before validation)."""
    allowed = set(valid_keys())
    sections = {k.split(".")[0] for k in allowed if "." in k}
    for text in overrides:
        path, value = parse_override(text)
        dotted = ".".join(path)
        # model.kwargs.hidden=..., data.keys.x=...: entries of a free-form mapping.
        in_mapping = any(".".join(path[:i]) in DICT_KEYS for i in range(1, len(path)))
        if path[0] in sections and len(path) == 1:
            raise ConfigError(f"--set {text!r}: {dotted!r} is a section; set one of its keys, "
                              f"e.g. {sorted(k for k in allowed if k.startswith(dotted + '.'))[0]}=...")
        if dotted not in allowed and not in_mapping:
            near = [k for k in sorted(allowed) if k.split(".")[-1] == path[-1] or k.startswith(path[0] + ".")]
            raise ConfigError(f"--set {text!r}: unknown key {dotted!r}; valid keys: "
                              f"{', '.join(near or sorted(allowed))}")
        node = data
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {text!r}: {part!r} is not a mapping in the config")
            node = nxt
        node[path[-1]] = value
    return data


def _resolve_paths(data: Dict[str, Any], base: Path) -> None:
    """Make relative data paths and user files (model factory, loss, metrics, callbacks)
    relative to the YAML file's directory: one rule for every path in a config."""
    callbacks = data.get("callbacks")
    if isinstance(callbacks, str):
        callbacks = [callbacks]
    if isinstance(callbacks, list):
        data["callbacks"] = [_resolve_spec(c, base) for c in callbacks]
    if isinstance(data.get("model"), dict) and "factory" in data["model"]:
        data["model"]["factory"] = _resolve_spec(data["model"]["factory"], base)
    if isinstance(data.get("loss"), str):
        data["loss"] = _resolve_spec(data["loss"], base)
    ev = data.get("eval")
    if isinstance(ev, dict) and isinstance(ev.get("metrics"), list):
        ev["metrics"] = [_resolve_spec(m, base) for m in ev["metrics"]]
    d = data.get("data")
    if not isinstance(d, dict):
        return
    for role in ("train", "test"):
        items = d.get(role)
        if isinstance(items, str):
            items = [items]
        if isinstance(items, list):
            d[role] = [p if not isinstance(p, str) or Path(p).is_absolute() else str(base / p) for p in items]


def _resolve_spec(spec: Any, base: Path) -> Any:
    """``"my.py:Cls"`` -> ``"<base>/my.py:Cls"``; module specs and absolute files unchanged."""
    if not isinstance(spec, str):
        return spec
    mod, sep, name = spec.rpartition(":")
    if not sep or not mod.endswith(".py") or Path(mod).is_absolute():
        return spec
    return f"{base / mod}:{name}"


def load_config(path: Union[str, Path, None] = None, overrides: Sequence[str] = (),
                data: Optional[Mapping[str, Any]] = None) -> TrainConfig:
    """Read a YAML file (or take ``data``), apply ``--set`` overrides, validate.

    Relative ``data.train``/``data.test`` paths and ``callbacks`` files are resolved against
    the YAML file's directory; ``run_dir`` and ``checkpoint.dir`` against the current directory.
    """
    import yaml

    raw: Dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist\nHINT: see examples/digits.yaml")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping of keys at the top level, got {type(loaded).__name__}")
        raw = loaded
        _resolve_paths(raw, p.resolve().parent)
    if data is not None:
        raw = _merge(raw, dict(data))
    try:
        raw = apply_overrides(raw, overrides)
        return config_from_dict(raw)
    except ConfigError as exc:
        if path is None:
            raise
        raise ConfigError(f"{path}: {exc}") from None


def _merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
