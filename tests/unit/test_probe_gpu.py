"""The GPU path of the probe and tuner, run when a GPU is present. On a CPU machine these
tests skip with the reason printed — and fail instead when HPCTRAIN_REQUIRE_GPU=1."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from hpctrain.probe import collect_gpus
from require import skip_or_fail

pytestmark = pytest.mark.gpu


def gpu_or_skip():
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return
    reason = (f"no usable GPU (torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"notes: {'; '.join(collect_gpus().notes)})")
    skip_or_fail("gpu", reason)


def test_gpu_inventory_matches_torch():
    gpu_or_skip()
    import torch

    inv = collect_gpus()
    assert inv.source in ("nvml", "torch")
    assert len(inv.visible_gpus()) == torch.cuda.device_count()
    g = inv.visible_gpus()[0]
    props = torch.cuda.get_device_properties(0)
    assert g.memory_total and abs(g.memory_total - props.total_memory) < 0.05 * props.total_memory
    assert g.compute_capability in (None, f"{props.major}.{props.minor}")


def test_gpu_tuner_within_10_percent_with_memory_cap():
    gpu_or_skip()
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from examples.tune_wide import factory
    from hpctrain.probe import tune_batch_size
    from hpctrain.probe.tuner import TrialRunner

    target = factory()
    cap = 512 << 20
    result = tune_batch_size(target.model_factory, target.make_batch, target.optimizer_factory, target.loss_fn,
                             max_memory=cap, device="cuda")
    assert result.device.startswith("cuda")
    runner = TrialRunner(target, result.device, cap, int(cap * 0.9))
    runner.warm_up()
    b = result.per_device_batch
    assert runner(b).fits
    b_star = b
    while runner(b_star + 1).fits:  # exhaustive above the answer (below it fits: monotone)
        b_star += 1
    assert b >= 0.9 * b_star
    assert len(result.trials) <= math.ceil(math.log2(b_star)) + 3
    torch.cuda.empty_cache()


def test_gpu_out_of_memory_is_caught_and_freed():
    gpu_or_skip()
    import torch

    from hpctrain.probe.tuner import is_out_of_memory

    free, total = torch.cuda.mem_get_info()
    try:
        torch.empty(int(total * 2), dtype=torch.uint8, device="cuda")
    except Exception as exc:  # noqa: BLE001
        assert is_out_of_memory(exc)
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info()[0] >= 0.9 * free
