"""A batch-size tuning target for `hpctrain probe --tune-batch examples/tune_mlp.py:factory`.

An MLP on 1024 features, 10 classes, SGD with momentum; base learning rate 0.1 known to
work at a global batch of 256. Try:

    hpctrain probe --tune-batch examples.tune_mlp:factory --max-memory 512MiB
    hpctrain launch -n 2 -- hpctrain probe --tune-batch examples.tune_mlp:factory --max-memory 512MiB
"""
from __future__ import annotations

import torch
from torch import nn

from hpctrain.probe import TuneTarget

FEATURES, HIDDEN, CLASSES = 1024, 2048, 10


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def make_batch(batch_size: int):
    g = torch.Generator().manual_seed(batch_size)
    return torch.randn(batch_size, FEATURES, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)


def factory(hidden: int = HIDDEN) -> TuneTarget:
    """The FACTORY protocol: a zero-argument call returning a TuneTarget."""
    return TuneTarget(
        model_factory=make_model,
        make_batch=make_batch,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        loss_fn=nn.functional.cross_entropy,
        base_lr=0.1,
        base_batch=256,
        lr_rule="linear",
    )
