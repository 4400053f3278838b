"""Early stopping, mixed precision's agreed scaler, normalisation statistics, clipping: pure parts."""
import numpy as np
import pytest
import torch

from hpctrain.train.clipping import clip_gradients
from hpctrain.train.normalize import FeatureStats, Normalized, Normalizer, NormalizeError
from hpctrain.train.precision import AgreedScaler, PrecisionError, autocast, check_precision
from hpctrain.train.stopping import Improvement, StoppingError


def test_early_stopping_max_with_patience_and_min_delta():
    s = Improvement("f1", patience=2, min_delta=0.01)
    assert s.mode == "max"
    seq = [0.5, 0.6, 0.605, 0.7, 0.69, 0.7, 0.71]
    verdicts = [s.update({"test_f1": v}) for v in seq]
    assert [v.improved for v in verdicts] == [True, True, False, True, False, False, False]
    assert [v.stop for v in verdicts] == [False, False, False, False, False, True, True]
    assert s.best == 0.7


def test_early_stopping_min_for_loss_resumes_its_state():
    s = Improvement("loss", patience=3)
    for v in (1.0, 0.8, 0.9):
        s.update({"test_loss": v})
    t = Improvement("loss", patience=3)
    t.load_state_dict(s.state_dict())
    assert (t.best, t.waited, t.mode) == (0.8, 1, "min")
    assert not t.update({"test_loss": float("nan")}).improved


def test_early_stopping_missing_metric_says_how_to_add_it():
    with pytest.raises(StoppingError, match="add f1 to eval.metrics"):
        Improvement("f1").update({"test_loss": 1.0})
    with pytest.raises(StoppingError, match="patience"):
        Improvement("f1", patience=-1)


def test_scaler_skips_on_every_rank_when_any_rank_overflows():
    votes = []
    flags = iter([False, True, False])          # the other rank's overflow flag per step
    any_rank = lambda local: votes.append(local) or (local or next(flags))  # noqa: E731
    sc = AgreedScaler(any_rank, init_scale=8.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(3))
    results = []
    for _ in range(3):
        p.grad = torch.full((3,), 8.0)
        results.append(sc.unscale_and_check([p]))
    assert results == [True, False, True]          # step 2 skipped though this rank was finite
    assert votes == [False, False, False]
    assert sc.scale == 4.0 and sc.skipped == 1
    assert torch.equal(p.grad, torch.full((3,), 2.0))   # unscaled by the backed-off scale 4


def test_scaler_grows_after_clean_steps_and_flags_local_inf():
    sc = AgreedScaler(lambda local: local, init_scale=4.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(1))
    for _ in range(2):
        p.grad = torch.ones(1)
        assert sc.unscale_and_check([p])
    assert sc.scale == 8.0
    p.grad = torch.tensor([float("inf")])
    assert not sc.unscale_and_check([p]) and sc.scale == 4.0


def test_bf16_autocast_on_cpu_and_fp16_refused():
    check_precision("bf16", torch.device("cpu"))
    with pytest.raises(PrecisionError, match="HINT: use precision: bf16"):
        check_precision("fp16", torch.device("cpu"))
    lin = torch.nn.Linear(4, 2)
    with autocast("bf16", torch.device("cpu")):
        assert lin(torch.randn(3, 4)).dtype == torch.bfloat16
    with autocast("fp32", torch.device("cpu")):
        assert lin(torch.randn(3, 4)).dtype == torch.float32


@pytest.mark.parametrize("mode", ["standard", "minmax"])
def test_normalizer_from_rank_shares_equals_whole_data(mode):
    rng = np.random.default_rng(0)
    x = rng.normal(5.0, 3.0, size=(101, 4))
    x[:, 3] = 7.0                                   # a constant feature: scale 1, not a division by 0
    shares = [x[:10], x[10:10], x[10:]]
    stats = [FeatureStats(4) for _ in shares]
    for st, part in zip(stats, shares):
        for i in range(0, len(part), 16):
            st.update(part[i:i + 16])
    sums = sum(st.sums for st in stats)
    low = np.min([st.low for st in stats], axis=0)
    high = np.max([st.high for st in stats], axis=0)
    norm = Normalizer.from_totals(mode, sums, low, high)
    out = norm(torch.from_numpy(x).float()).double().numpy()
    if mode == "standard":
        assert np.allclose(out[:, :3].mean(0), 0, atol=1e-5) and np.allclose(out[:, :3].std(0), 1, atol=1e-4)
    else:
        assert np.allclose(out[:, :3].min(0), 0, atol=1e-6) and np.allclose(out[:, :3].max(0), 1, atol=1e-6)
    assert np.allclose(out[:, 3], 0)
    again = Normalizer.from_state(norm.state())
    assert torch.equal(again(torch.ones(2, 4)), norm(torch.ones(2, 4)))
    model = Normalized(norm, torch.nn.Identity())
    assert torch.equal(model(torch.ones(2, 4)), norm(torch.ones(2, 4)))


def test_normalizer_errors_name_the_widths():
    with pytest.raises(NormalizeError, match="3 features, expected 4"):
        FeatureStats(4).update(np.ones((2, 3)))
    norm = Normalizer.from_totals("standard", np.array([2.0, 1, 1, 1, 1]), np.zeros(2), np.ones(2))
    with pytest.raises(NormalizeError, match="input has 3 features"):
        norm(torch.ones(1, 3))


def test_clip_norm_and_value_and_stage_sum():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    assert clip_gradients([a, b], max_norm=1.0) == pytest.approx(5.0)
    assert torch.allclose(torch.cat([a.grad, b.grad]).norm(), torch.tensor(1.0), atol=1e-5)
    a.grad = torch.tensor([3.0, 0.0])
    # another stage holds gradients of squared norm 16: the global norm is 5
    total = clip_gradients([a], max_norm=2.5, squared_norm_sum=lambda local: local + 16.0)
    assert total == pytest.approx(5.0) and a.grad[0] == pytest.approx(1.5, abs=1e-5)
    a.grad = torch.tensor([3.0, -7.0])
    clip_gradients([a], max_value=2.0)
    assert a.grad.tolist() == [2.0, -2.0]


def test_resource_monitor_samples_in_the_background():
    import time

    from hpctrain.train.monitor import FIELDS, ResourceMonitor

    calls = []
    fake_gpu = lambda: calls.append(1) or {"gpu_util": 42.0, "gpu_mem_mb": 1000.0}  # noqa: E731
    with ResourceMonitor(interval=0.05, gpu=fake_gpu) as mon:
        x = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.4:     # keep the CPU busy so the utilisation is non-zero
            x += 1
        s = mon.latest()
    assert set(s) == set(FIELDS)
    assert mon.samples >= 3 and len(calls) == mon.samples
    assert s["gpu_util"] == 42.0 and s["rss_mb"] > 10 and s["cpu_percent"] > 0
    n = mon.samples
    time.sleep(0.2)
    assert mon.samples == n                     # stopped


def test_resource_monitor_first_sample_is_the_average_since_start():
    """A short run logs before the thread's first interval ends: that sample must not read 0 %."""
    import time

    from hpctrain.train.monitor import ResourceMonitor

    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:      # this process has used CPU before the monitor starts
        pass
    assert ResourceMonitor(interval=10).sample_once()["cpu_percent"] > 0


def test_resource_monitor_drops_a_failing_gpu_reader():
    from hpctrain.train.monitor import ResourceMonitor

    def broken():
        raise RuntimeError("NVML gone")

    mon = ResourceMonitor(interval=10, gpu=broken)
    assert mon.sample_once()["gpu_util"] == -1.0 and mon._gpu is None
