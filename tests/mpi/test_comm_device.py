"""The collectives that hand a tensor's memory to MPI as it is (the CUDA-aware path), run on
CPU tensors under mpiexec: mpi4py takes a torch tensor through DLPack wherever it lives, so
the same code moves CUDA memory with a CUDA-aware MPI. Expected values from rank and size.

The second half routes hpctrain.torch's calls through that path (``on_device`` patched to
take every tensor), as it runs for CUDA tensors when the MPI library is CUDA-aware."""
import pytest
import torch

import hpctrain.torch as hvd
from hpctrain import comm
from hpctrain.comm import buffers, device
from hpctrain.torch import backends

RANKS = (1, 3)
TIMEOUT = 240

hvd.init()
R, N = hvd.rank(), hvd.size()
G = comm.world()
torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
                                   torch.float16, torch.bfloat16])
def test_allreduce_on_the_tensor_memory(dtype):
    x = torch.full((3, 5), R + 1, dtype=dtype)
    out = device.allreduce(G, x, "sum", inplace=False)
    assert out.dtype == dtype and torch.equal(out, torch.full((3, 5), N * (N + 1) // 2, dtype=dtype))
    assert torch.equal(x, torch.full((3, 5), R + 1, dtype=dtype))
    assert device.allreduce(G, x, "max", inplace=True) is x and torch.equal(x, torch.full((3, 5), N, dtype=dtype))
    y = torch.full((4,), 2 * (R + 1), dtype=dtype)
    device.allreduce(G, y, "avg", inplace=True)
    assert torch.equal(y, torch.full((4,), N + 1, dtype=dtype))  # (2 + 4 + ... + 2N) / N exactly


def test_broadcast_allgather_alltoall_reduce_scatter():
    x = torch.arange(6, dtype=torch.bfloat16) + R
    assert device.broadcast_(G, x, root=N - 1) is x and torch.equal(x, torch.arange(6, dtype=torch.bfloat16) + N - 1)
    mine = torch.full((R + 1, 2), R, dtype=torch.float32)  # rank r sends r + 1 rows
    got = device.allgather(G, mine)
    assert torch.equal(got, torch.cat([torch.full((r + 1, 2), r, dtype=torch.float32) for r in range(N)]))
    rows = torch.arange(N * 2, dtype=torch.int64).reshape(N, 2) + 100 * R  # row i goes to rank i
    out, received = device.alltoall(G, rows, None)
    assert received.tolist() == [1] * N
    assert torch.equal(out, torch.stack([torch.tensor([2 * R, 2 * R + 1]) + 100 * r for r in range(N)]))
    full = torch.arange(N + 1, dtype=torch.float64) * (R + 1)
    part = device.reduce_scatter(G, full, "sum")
    lo, hi = comm.plan.chunk_bounds(N + 1, N)[R]
    assert torch.equal(part, torch.arange(lo, hi, dtype=torch.float64) * N * (N + 1) / 2)


def test_a_mismatch_across_ranks_is_reported_not_hung():
    if N < 2:
        pytest.skip("needs two ranks")
    x = torch.ones(10 if R == 0 else 11)
    with pytest.raises(comm.CollectiveMismatchError):
        device.allreduce(G, x, "sum", inplace=True)


@pytest.fixture
def as_if_on_the_gpu(monkeypatch):
    """Every tensor takes the device path; count the collectives that ran there."""
    calls = []
    for name in ("allreduce", "allgather", "broadcast_", "alltoall", "reduce_scatter"):
        real = getattr(device, name)
        monkeypatch.setattr(device, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    monkeypatch.setattr(device, "on_device", buffers.is_torch_tensor)
    return calls


def test_hvd_calls_run_on_the_device_path(as_if_on_the_gpu):
    x = torch.arange(6, dtype=torch.float32) * (R + 1)
    assert torch.allclose(hvd.allreduce(x), torch.arange(6, dtype=torch.float32) * (N + 1) / 2)
    assert torch.allclose(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
                          torch.arange(6, dtype=torch.float32) * N * (N + 1) / 2)
    assert torch.equal(hvd.broadcast(x, root_rank=0), torch.arange(6, dtype=torch.float32))
    assert hvd.allgather(torch.full((1, 2), R)).tolist() == [[r, r] for r in range(N)]
    assert hvd.alltoall(torch.arange(N) + 10 * R).tolist() == [R + 10 * r for r in range(N)]
    assert torch.equal(hvd.reducescatter(torch.ones(N, 2), op=hvd.Sum), torch.full((1, 2), float(N)))
    buf = torch.full((5,), float(R))
    backends.MPIBackend().allreduce_async(buf, "sum").wait()
    assert torch.equal(buf, torch.full((5,), float(N * (N - 1) / 2)))
    assert as_if_on_the_gpu == ["allreduce", "allreduce", "broadcast_", "allgather", "alltoall",
                                "reduce_scatter", "allreduce"]
