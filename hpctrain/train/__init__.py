"""hpctrain.train — the training runner: typed config, ``Trainer(config).fit()``, atomic
checkpoints with bit-identical resume, metrics, timeline, straggler detection and reports.

    from hpctrain.train import Trainer, load_config
    result = Trainer(load_config("examples/digits.yaml")).fit()

See docs/train.md. Heavy modules (torch, the loader) are imported on first use.
"""
from hpctrain.train.config import (ConfigError, TrainConfig, apply_overrides, config_from_dict, load_config,
                                   valid_keys)

__all__ = ["Trainer", "FitResult", "TrainConfig", "ConfigError", "load_config", "config_from_dict",
           "apply_overrides", "valid_keys"]


def __getattr__(name: str):
    if name in ("Trainer", "FitResult"):
        from hpctrain.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'hpctrain.train' has no attribute {name!r}")
