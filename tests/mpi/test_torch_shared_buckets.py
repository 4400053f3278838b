"""DistributedOptimizer puts its buckets in the node's shared window by default (MPI backend,
CPU, several ranks; across nodes each node's window holds its ranks' buckets): gradients are
all-reduced in place, zero-copy, and training matches the private-buffer path. Small buckets
(below the agreement check's in-band limit across nodes, the flag exchange on one node) and
large ones (the hierarchical path across nodes, from 4 MiB)."""
import pytest
import torch

import hpctrain.torch as hvd
from hpctrain import comm, settings

RANKS = (2, 3)
TIMEOUT = 240

hvd.init()

SIZES = {  # hidden width, fusion threshold
    "small buckets": (64, 4096),
    "large buckets": (1024, 1 << 20),  # the 1024 x 1024 weight (4 MiB) a bucket of its own
}


def train(shared: bool, hidden: int, fusion: int, steps: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
    with settings.override(shared_buckets=shared):  # HPCTRAIN_SHARED_BUCKETS
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), fusion_threshold=fusion)
    g = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(steps):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def in_shared_window(t: torch.Tensor) -> bool:
    arr = t.detach().view(-1).numpy()
    return any(sbuf.locate(arr) is not None for sbuf in comm.world().shared_buffers)


@pytest.mark.parametrize("size", list(SIZES))
def test_buckets_live_in_the_shared_window_and_match_private_buffers(size):
    hidden, fusion = SIZES[size]
    model_s, opt_s = train(True, hidden, fusion)
    assert opt_s.shared_buckets
    assert len(opt_s.plan.buckets) > 1
    assert all(in_shared_window(p.grad) for p in model_s.parameters())
    model_p, opt_p = train(False, hidden, fusion)
    assert not any(in_shared_window(p.grad) for p in model_p.parameters())
    for a, b in zip(model_s.parameters(), model_p.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # every rank holds the same weights: the all-reduce reached every node
    for p in model_s.parameters():
        ref = comm.broadcast(p.detach().numpy().copy(), root=0)
        assert torch.equal(p.detach(), torch.from_numpy(ref))
