"""Pure parts of hpctrain.torch: compression, strategies' math, sampler, lr helpers,
SyncBatchNorm moment combination, and errors before init()."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpctrain.torch as hvd
from hpctrain.torch.helpers import scale_lr, shard_indices, warmup_factor
from hpctrain.torch.strategies import AllReduce, ModelAverage, ParameterServer, parse_sync, weighted_average
from hpctrain.torch.sync_batch_norm import combine_moments


@pytest.mark.parametrize("comp,dtype,tol", [(hvd.Compression.fp16, torch.float16, 2 ** -11),
                                            (hvd.Compression.bf16, torch.bfloat16, 2 ** -8)])
def test_compression_roundtrip(comp, dtype, tol):
    x = torch.randn(1000) * 10
    wire, ctx = comp.compress(x)
    assert wire.dtype == dtype
    back = comp.decompress(wire, ctx)
    assert back.dtype == torch.float32
    assert float(((back - x).abs() / x.abs().clamp_min(1e-3)).max()) <= tol
    ints = torch.arange(5)
    assert comp.compress(ints)[0] is ints
    none_wire, _ = hvd.Compression.none.compress(x)
    assert none_wire is x


def test_parse_sync():
    assert parse_sync(None) == AllReduce()
    assert parse_sync("parameter_server:2") == ParameterServer(server_rank=2)
    assert parse_sync("model-average:8") == ModelAverage(every=8)
    assert parse_sync(ModelAverage(3)) == ModelAverage(3)
    for bad in ("gossip", "model_average:x", "allreduce:1", "model_average:0"):
        with pytest.raises(ValueError):
            parse_sync(bad)


def test_weighted_average():
    a, b = torch.tensor([0.0, 2.0]), torch.tensor([4.0, 6.0])
    assert torch.equal(weighted_average([a, b], [1, 3]), torch.tensor([3.0, 5.0]))
    assert torch.equal(weighted_average([a, b], [0, 0]), torch.tensor([2.0, 4.0]))


@settings(max_examples=200, deadline=None)
@given(length=st.integers(0, 300), n=st.integers(1, 9), seed=st.integers(0, 5), epoch=st.integers(0, 3),
       drop_last=st.booleans(), shuffle=st.booleans())
def test_sampler_shards(length, n, seed, epoch, drop_last, shuffle):
    shards = [shard_indices(length, n, r, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last)
              for r in range(n)]
    counts = {len(s) for s in shards}
    assert len(counts) == 1  # equal steps on every rank
    flat = [i for s in shards for i in s]
    if drop_last:
        assert len(flat) == (length // n) * n and len(set(flat)) == len(flat)
    else:
        assert set(flat) == set(range(length))  # complete (padding repeats indices)
        assert len(flat) == (math.ceil(length / n) * n if length else 0)
    # deterministic per (seed, epoch)
    assert shards[0] == shard_indices(length, n, 0, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last)


def test_sampler_class():
    s = hvd.DistributedSampler(list(range(10)), num_replicas=3, rank=1, shuffle=False)
    assert list(s) == [1, 4, 7, 0][:len(s)] and len(s) == 4
    s.set_epoch(1)
    with pytest.raises(ValueError, match="rank"):
        hvd.DistributedSampler(10, num_replicas=2, rank=2)


def test_lr_helpers():
    assert scale_lr(0.1, 4) == pytest.approx(0.4)
    assert scale_lr(0.1, 4, "sqrt") == pytest.approx(0.2)
    assert scale_lr(0.1, 4, "none") == 0.1
    with pytest.raises(ValueError):
        scale_lr(0.1, 4, "cubic")
    assert warmup_factor(0, 10, 4) == pytest.approx(0.25)
    assert warmup_factor(10, 10, 4) == 1.0


def test_combine_moments_equals_whole_batch():
    torch.manual_seed(0)
    parts = [torch.randn(n, 3, dtype=torch.float64) * 3 + 1 for n in (1, 5, 0, 7)]
    counts = torch.tensor([float(p.shape[0]) for p in parts], dtype=torch.float64)
    means = torch.stack([p.mean(0) if len(p) else torch.zeros(3, dtype=torch.float64) for p in parts])
    m2s = torch.stack([((p - p.mean(0)) ** 2).sum(0) if len(p) else torch.zeros(3, dtype=torch.float64)
                       for p in parts])
    total, mean, var = combine_moments(counts, means, m2s)
    whole = torch.cat(parts)
    assert float(total) == 13
    assert torch.allclose(mean, whole.mean(0)) and torch.allclose(var, whole.var(0, unbiased=False))


BEFORE_INIT = r"""
import torch, hpctrain.torch as hvd
def expect(fn, what):
    try:
        fn()
    except ValueError as exc:
        assert "hvd.init()" in str(exc) and "HINT" in str(exc), exc
        print("ok", what)
    else:
        raise SystemExit(what + ": no error")
model = torch.nn.Linear(2, 2)
expect(lambda: hvd.rank(), "rank")
expect(lambda: hvd.allreduce(torch.ones(1)), "allreduce")
expect(lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)), "optimizer")
hvd.init()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
model(torch.ones(1, 2)).sum().backward()
opt.step()
hvd.shutdown()
expect(lambda: opt.step(), "step after shutdown")
"""


def test_calls_before_init_are_clear_errors():
    """A fresh process: every entry point before init() (and step() after shutdown()) says
    to call hvd.init(), instead of failing deep inside MPI."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", BEFORE_INIT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok") == 4


def test_api_surface_has_horovod_names():
    names = """init shutdown is_initialized rank size local_rank local_size cross_rank cross_size mpi_enabled
    mpi_built gloo_enabled gloo_built nccl_built mpi_threads_supported allreduce allreduce_ allreduce_async
    allreduce_async_ grouped_allreduce grouped_allreduce_ allgather allgather_async broadcast broadcast_
    broadcast_async broadcast_async_ alltoall reducescatter synchronize poll join barrier broadcast_object
    allgather_object broadcast_parameters broadcast_optimizer_state Average Sum Min Max Product Adasum
    Compression DistributedOptimizer SyncBatchNorm metric_average DistributedSampler""".split()
    missing = [n for n in names if not hasattr(hvd, n)]
    assert not missing
    for name in hvd.__all__:
        obj = getattr(hvd, name)
        if callable(obj) and not isinstance(obj, int):
            assert obj.__doc__, f"{name} has no docstring"


def test_choose_overlap():
    from hpctrain.torch.optimizer import choose_overlap

    assert not choose_overlap(2, 2, 2, 1)      # 2 ranks on 2 unbound cores: no core to spare
    assert choose_overlap(64, 64, 8, 4)        # 32 of 64 cores busy computing
    assert not choose_overlap(1, 64, 8, 1)     # bound to one core
    assert choose_overlap(4, 64, 8, 2)         # bound to 4 cores, 2 compute threads
    assert not choose_overlap(16, 16, 4, 4)
