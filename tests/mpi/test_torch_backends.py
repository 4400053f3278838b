"""DistributedOptimizer over the torch.distributed Gloo backend (rendezvous bootstrapped through
MPI, no MASTER_ADDR) equals the MPI backend and 1-process training."""

import pytest
import torch

import hpctrain.torch as hvd
from hpctrain import comm
from hpctrain.torch import backends, staging
from require import skip_or_fail

RANKS = (1, 3)
TIMEOUT = 240

hvd.init()
R, N = hvd.rank(), hvd.size()
torch.set_num_threads(1)
B = 3


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2)).double()


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(N * B, 6, generator=g).double(), torch.randn(N * B, 2, generator=g).double()


def train(backend, steps=3, **kw):
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5),
                                   named_parameters=m.named_parameters(), backend=backend, **kw)
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x[R * B:(R + 1) * B]), y[R * B:(R + 1) * B]).backward()
        opt.step()
    return m


def reference(steps=3):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return m


def close(a, b, tol=1e-12):
    return all(torch.allclose(p, q, rtol=tol, atol=tol) for p, q in zip(a.parameters(), b.parameters()))


def test_gloo_backend_matches_reference():
    if not hvd.gloo_built():
        skip_or_fail("gloo", "this PyTorch has no Gloo")
    ref = reference()
    assert close(train("gloo", fusion_threshold=0), ref)
    assert close(train("gloo"), ref)
    import torch.distributed as dist

    assert dist.is_initialized() and dist.get_world_size() == N and dist.get_rank() == R
    # the process group's store is rank 0's TCPStore itself, on one port for every rank
    store = dist.distributed_c10d._get_default_store()
    store = getattr(store, "underlying_store", store)
    assert isinstance(store, dist.TCPStore)
    assert len(set(comm.allgather_object(store.port))) == 1


def test_the_rendezvous_port_is_the_store_s_own_never_probed(monkeypatch):
    """No free-port probe (bind, close, bind again: a window in which another process can
    take the port): rank 0's store binds port 0 itself and keeps it, so no Python socket is
    bound at all, and every rank reaches the same store."""
    import socket

    def no_bind(*args, **kwargs):
        raise AssertionError("the rendezvous bound a Python socket (a probed port)")

    monkeypatch.setattr(socket.socket, "bind", no_bind)
    assert not hasattr(comm, "rendezvous_address")
    store = comm.rendezvous_store(timeout_s=60)
    assert store.port > 0 and len(set(comm.allgather_object(store.port))) == 1
    if R == 0:
        store.set("hello", f"from rank 0 on port {store.port}")
    assert store.get("hello") == f"from rank 0 on port {comm.allgather_object(store.port)[0]}".encode()
    comm.barrier()  # rank 0's store (the server) lives until every rank has read


def test_mpi_backend_matches_reference():
    assert close(train("mpi", fusion_threshold=64), reference())


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="backend='carrier-pigeon'"):
        backends.get_backend("carrier-pigeon")


def test_horovod_backend_needs_horovod():
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="horovod"):
            backends.get_backend("horovod")


def test_cpu_tensors_are_not_staged():
    x = torch.ones(3)
    host, restore = staging.to_host(x)
    assert host is x and restore(host) is x


def test_horovod_backend_matches_reference():
    """Last in this file: once Horovod's background thread runs, it slows other MPI traffic."""
    try:
        import horovod.torch  # noqa: F401
    except ImportError as exc:
        skip_or_fail("horovod", f"horovod.torch does not import: {exc}")
    assert close(train("horovod"), reference())
