"""hpctrain.torch collectives and functions under mpiexec; expected values from rank/size."""
import pytest
import torch

import hpctrain.torch as hvd
from hpctrain import comm

RANKS = (2, 3)
TIMEOUT = 240

hvd.init()
R, N = hvd.rank(), hvd.size()
torch.set_num_threads(1)


def ranks_sum():
    return N * (N - 1) / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32])
def test_allreduce_ops(dtype):
    x = torch.full((3, 5), R + 1, dtype=dtype)
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.full((3, 5), N * (N + 1) // 2, dtype=dtype))
    assert torch.equal(hvd.allreduce(x, op=hvd.Max), torch.full((3, 5), N, dtype=dtype))
    assert torch.equal(hvd.allreduce(x, op=hvd.Min), torch.full((3, 5), 1, dtype=dtype))
    if dtype.is_floating_point:
        avg = hvd.allreduce(x)
        assert torch.allclose(avg.double(), torch.full((3, 5), (N + 1) / 2, dtype=torch.float64), rtol=1e-2)
    fact = 1
    for r in range(1, N + 1):
        fact *= r
    assert torch.equal(hvd.allreduce(torch.full((2,), R + 1, dtype=torch.float64), op=hvd.Product),
                       torch.full((2,), float(fact), dtype=torch.float64))
    assert torch.equal(x, torch.full((3, 5), R + 1, dtype=dtype))  # input untouched


def test_allreduce_variants():
    x = torch.arange(6, dtype=torch.float64) * (R + 1)
    expected = torch.arange(6, dtype=torch.float64) * (N + 1) / 2
    assert torch.allclose(hvd.allreduce(x, average=True), expected)
    assert torch.allclose(hvd.allreduce(x, average=False), expected * N)
    assert torch.allclose(hvd.allreduce(x, prescale_factor=2.0, postscale_factor=0.5), expected)
    assert torch.allclose(hvd.allreduce(x.float(), compression=hvd.Compression.fp16).double(), expected, rtol=1e-3)
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.allclose(y, expected * N)
    h = hvd.allreduce_async(x, op=hvd.Sum)
    assert torch.allclose(hvd.synchronize(h), expected * N)
    with pytest.raises(ValueError, match="cleared"):  # Horovod: synchronize() releases the handle
        hvd.poll(h)
    z = x.clone()
    h = hvd.allreduce_async_(z)
    out = hvd.synchronize(h)
    assert out is z and torch.allclose(z, expected)
    if N & (N - 1):  # Adasum (tests/mpi/test_adasum.py) needs a power-of-two number of ranks, as in Horovod
        with pytest.raises(NotImplementedError, match="Adasum with non-power of 2"):
            hvd.allreduce(x, op=hvd.Adasum)
    else:  # x = (R + 1) a on rank R; at 2 ranks Adasum(a, 2a) = 0·a + (1 - 2/8)·2a = 1.5a
        same = torch.arange(6, dtype=torch.float64)
        assert torch.allclose(hvd.allreduce(same, op=hvd.Adasum), same)  # Adasum(a, a) = a
        if N == 2:
            assert torch.allclose(hvd.allreduce(x, op=hvd.Adasum), 1.5 * same)


def test_allreduce_is_differentiable():
    x = torch.ones(4, dtype=torch.float64, requires_grad=True)
    (hvd.allreduce(x * (R + 1), op=hvd.Sum) * 2).sum().backward()
    # d/dx_r of sum_r'(x_r' * (r'+1)) summed over ranks' losses: each rank's loss sees every x
    assert torch.allclose(x.grad, torch.full((4,), 2.0 * N * (R + 1), dtype=torch.float64))


def test_grouped_allreduce():
    ts = [torch.full((2,), float(R)), torch.full((3, 1), float(R), dtype=torch.float64), torch.full((1,), R)]
    out = hvd.grouped_allreduce(ts, op=hvd.Sum)
    assert [o.shape for o in out] == [t.shape for t in ts]
    assert all(torch.all(o == ranks_sum()) for o in out)
    hvd.grouped_allreduce_(ts, op=hvd.Sum)
    assert all(torch.all(t == ranks_sum()) for t in ts)
    h = hvd.grouped_allreduce_async([torch.ones(2)])
    assert torch.equal(hvd.synchronize(h)[0], torch.ones(2))


def test_allgather_uneven_and_differentiable():
    x = torch.full((R + 1, 2), float(R))
    out = hvd.allgather(x)
    assert out.shape == (N * (N + 1) // 2, 2)
    assert torch.equal(out[:, 0], torch.cat([torch.full((r + 1,), float(r)) for r in range(N)]))
    assert torch.equal(hvd.synchronize(hvd.allgather_async(x)), out)
    v = torch.ones(R + 1, 2, dtype=torch.float64, requires_grad=True)
    hvd.allgather(v).sum().backward()
    # Horovod's allgather gradient: this rank's rows of the *average* of the output gradients.
    assert torch.allclose(v.grad, torch.ones_like(v))


def test_broadcast_variants():
    root = N - 1
    x = torch.full((2, 3), float(R))
    assert torch.equal(hvd.broadcast(x, root), torch.full((2, 3), float(root)))
    assert torch.equal(x, torch.full((2, 3), float(R)))
    y = x.clone()
    assert hvd.broadcast_(y, root) is y and torch.equal(y, torch.full((2, 3), float(root)))
    assert torch.equal(hvd.synchronize(hvd.broadcast_async(x, 0)), torch.zeros(2, 3))
    z = x.clone()
    hvd.synchronize(hvd.broadcast_async_(z, 0))
    assert torch.equal(z, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(x, N)


def test_alltoall():
    x = torch.arange(N * 2, dtype=torch.float32) + 100 * R
    out = hvd.alltoall(x)
    assert torch.equal(out, torch.cat([torch.tensor([2 * R, 2 * R + 1], dtype=torch.float32) + 100 * r for r in range(N)]))
    splits = [r + 1 for r in range(N)]  # send r+1 rows to rank r
    x = torch.full((sum(splits), 2), float(R))
    out, received = hvd.alltoall(x, splits=splits)
    assert received.tolist() == [R + 1] * N
    assert torch.equal(out[:, 0], torch.cat([torch.full((R + 1,), float(r)) for r in range(N)]))
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(x, splits=[1] * (N + 1))


def test_reducescatter_uneven_rows():
    rows = 2 * N + 1
    x = torch.arange(rows * 2, dtype=torch.float64).view(rows, 2) * (R + 1)
    out = hvd.reducescatter(x, op=hvd.Sum)
    q, rem = divmod(rows, N)
    start = R * q + min(R, rem)
    mine = q + (1 if R < rem else 0)
    full = torch.arange(rows * 2, dtype=torch.float64).view(rows, 2) * (N * (N + 1) / 2)
    assert torch.allclose(out, full[start:start + mine])
    avg = hvd.reducescatter(x)
    assert torch.allclose(avg, full[start:start + mine] / N)


def test_join_barrier_objects():
    last = hvd.join()
    assert 0 <= last < N
    hvd.barrier()
    assert hvd.broadcast_object({"r": R, "list": [R]}, root_rank=N - 1) == {"r": N - 1, "list": [N - 1]}
    assert hvd.allgather_object(("x", R)) == [("x", r) for r in range(N)]
    assert hvd.metric_average(float(R)) == pytest.approx((N - 1) / 2)
    assert hvd.metric_average(torch.tensor(2.0 * R)) == pytest.approx(N - 1)
    assert hvd.mpi_enabled() and hvd.mpi_built() and isinstance(hvd.gloo_built(), bool)
    assert isinstance(hvd.mpi_threads_supported(), bool)
    assert hvd.local_rank() < hvd.local_size() and hvd.cross_rank() < hvd.cross_size()
    assert hvd.is_homogeneous()


def test_sparse_optimizer_state_is_broadcast():
    # SGD's momentum on a sparse embedding's gradients is a sparse tensor: it travels dense and
    # every rank ends with root's, sparse again.
    torch.manual_seed(7)
    model = torch.nn.Embedding(6, 2, sparse=True).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([R % 6, (R + 2) % 6])).sum().backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    mine = opt.state_dict()["state"][0]["momentum_buffer"]
    assert mine.is_sparse
    roots = hvd.broadcast_object(mine.to_dense(), root_rank=0)
    assert torch.equal(mine.to_dense(), roots)


def test_broadcast_parameters_and_optimizer_state():
    torch.manual_seed(R)  # different weights per rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (R + 1))
    if R == 0:  # only root has optimizer state
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    everyone = hvd.allgather_object({k: v.clone() for k, v in model.state_dict().items()})
    for k, v in model.state_dict().items():
        assert torch.equal(v, everyone[0][k]), k
    sd = opt.state_dict()
    allsd = hvd.allgather_object(sd)
    assert sd["param_groups"][0]["lr"] == pytest.approx(0.01)
    assert len(sd["state"]) == len(allsd[0]["state"]) == 6
    for i, st in sd["state"].items():
        for key, val in st.items():
            assert torch.equal(torch.as_tensor(val), torch.as_tensor(allsd[0]["state"][i][key])), (i, key)
    # named_parameters() form, and the training continues identically
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)


def test_sync_batch_norm_equals_batch_norm_on_global_batch():
    torch.manual_seed(0)
    per = [2 + r for r in range(N)]  # uneven local batches
    x = torch.randn(sum(per), 3, 4, 4, dtype=torch.float64)
    dy = torch.randn_like(x)
    ref = torch.nn.BatchNorm2d(3).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    sync = hvd.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(ref)).double()
    sync = sync[0] if isinstance(sync, torch.nn.Sequential) else sync
    lo = sum(per[:R])
    xr = x[lo:lo + per[R]].clone().requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    out_ref = ref(xg)
    (out_ref * dy).sum().backward()
    out = sync(xr)
    (out * dy[lo:lo + per[R]]).sum().backward()
    assert torch.allclose(out, out_ref[lo:lo + per[R]], atol=1e-10)
    assert torch.allclose(xr.grad, xg.grad[lo:lo + per[R]], atol=1e-10)
    wgrad = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
    assert torch.allclose(wgrad, ref.weight.grad, atol=1e-10)
    assert torch.allclose(sync.running_mean, ref.running_mean) and torch.allclose(sync.running_var, ref.running_var)
    sync.eval()
    assert torch.allclose(sync(xr), ref.eval()(xr), atol=1e-12)


def test_process_set():
    evens = hvd.add_process_set(list(range(0, N, 2)))
    if evens.included():
        out = hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum, process_set=evens)
        assert float(out) == sum(range(0, N, 2))
        assert evens.size() == len(range(0, N, 2))
    else:
        with pytest.raises(ValueError, match="not in process set"):
            hvd.allreduce(torch.tensor([1.0]), process_set=evens)
    hvd.barrier()
    assert hvd.remove_process_set(evens)


def test_mismatched_shapes_fail_on_every_rank_without_hanging():
    if N == 1:
        return
    x = torch.ones(3 + (R == N - 1))
    with pytest.raises(comm.CommError):
        hvd.allreduce(x)
    hvd.barrier()  # still usable afterwards


def _fusion_batches(sizes, threshold):
    """Horovod's rule: consecutive same-dtype tensors, in order, while they fit the threshold."""
    batches, current, total = [], 0, 0
    for nbytes in sizes:
        if current and total + nbytes > threshold:
            batches.append(current)
            current, total = 0, 0
        current, total = current + 1, total + nbytes
    batches.append(current)
    return batches


@pytest.mark.parametrize("threshold", [None, "40"])
def test_outstanding_async_allreduces_are_fused(threshold, monkeypatch):
    # Horovod's tensor fusion: async all-reduces queued together run as one collective per
    # dtype, up to HOROVOD_FUSION_THRESHOLD bytes. A gate holds the background thread so that
    # every rank has all of them queued when it gets there (the ranks agree on the count).
    import threading

    from hpctrain.comm import asyncq

    if threshold is not None:
        monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", threshold)
    gate = threading.Event()
    asyncq.submit("gate", gate.wait)
    before = asyncq.fused_calls()
    xs = [torch.full((k + 1,), float(R + k)) for k in range(8)]
    handles = [hvd.allreduce_async(x, op=hvd.Sum, name=f"fuse.{k}") for k, x in enumerate(xs)]
    inplace = torch.full((3,), float(R), dtype=torch.float64)
    handles.append(hvd.allreduce_async_(inplace, op=hvd.Sum))  # another dtype: a batch of its own
    averaged = torch.full((2,), float(R))
    handles.append(hvd.allreduce_async(averaged, name="fuse.avg"))  # Average: another op
    gate.set()
    results = [hvd.synchronize(h) for h in handles]
    for k, got in enumerate(results[:8]):
        assert got.tolist() == [ranks_sum() + N * k] * (k + 1)
    assert results[8] is inplace and inplace.tolist() == [ranks_sum()] * 3
    assert results[9].tolist() == [(N - 1) / 2] * 2
    expected = _fusion_batches([4 * (k + 1) for k in range(8)], int(threshold or 1 << 27))
    assert asyncq.fused_calls() - before == sum(1 for b in expected if b > 1), expected


def test_an_async_allreduce_waits_one_cycle_for_company_unless_someone_waits(monkeypatch):
    # Horovod's cycle (HOROVOD_CYCLE_TIME): the background thread holds a fusable call for
    # that long after its submission, so calls issued right behind it are fused with it, and
    # poll() is False right after the call (Horovod's test_horovod_allreduce_async_fused);
    # synchronize() makes it run at once.
    import time

    from hpctrain.comm import asyncq

    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "300")  # ms
    hvd.barrier()
    before = asyncq.fused_calls()
    xs = [torch.full((4,), float(R + k)) for k in range(5)]
    handles = [hvd.allreduce_async(x, op=hvd.Sum, name=f"cycle.{k}") for k, x in enumerate(xs)]
    assert not any(hvd.poll(h) for h in handles)
    started = time.perf_counter()
    results = [hvd.synchronize(h) for h in handles]
    assert time.perf_counter() - started < 0.25  # not held for the whole cycle once waited for
    for k, got in enumerate(results):
        assert got.tolist() == [ranks_sum() + N * k] * 4
    assert asyncq.fused_calls() - before == 1  # the five in one collective


def test_cycle_time_setting(monkeypatch):
    from hpctrain.comm import asyncq

    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2.5")
    assert asyncq.cycle_seconds() == pytest.approx(0.0025)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "soon")
    with pytest.raises(ValueError, match="HOROVOD_CYCLE_TIME='soon'"):
        asyncq.cycle_seconds()
    monkeypatch.delenv("HOROVOD_CYCLE_TIME")
    assert asyncq.cycle_seconds() == pytest.approx(0.001)


def test_fusion_can_be_turned_off(monkeypatch):
    import threading

    from hpctrain.comm import asyncq

    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    gate = threading.Event()
    asyncq.submit("gate", gate.wait)
    before = asyncq.fused_calls()
    handles = [hvd.allreduce_async(torch.full((2,), float(R)), op=hvd.Sum, name=f"nofuse.{k}") for k in range(4)]
    gate.set()
    assert all(hvd.synchronize(h).tolist() == [ranks_sum()] * 2 for h in handles)
    assert asyncq.fused_calls() == before
