"""DistributedOptimizer puts its buckets in the node's shared window by default (one node,
MPI backend, CPU): gradients are all-reduced in place, zero-copy, and training matches the
private-buffer path exactly."""
import torch

import hpctrain.torch as hvd
from hpctrain import comm, settings

RANKS = (2, 3)
TIMEOUT = 240

hvd.init()


def train(shared: bool, steps: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    with settings.override(shared_buckets=shared):  # HPCTRAIN_SHARED_BUCKETS
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), fusion_threshold=4096)
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


def test_buckets_live_in_the_shared_window_and_match_private_buffers():
    model_s, opt_s = train(shared=True)
    assert len(opt_s.plan.buckets) > 1
    assert all(in_shared_window(p.grad) for p in model_s.parameters())
    model_p, opt_p = train(shared=False)
    assert not any(in_shared_window(p.grad) for p in model_p.parameters())
    for a, b in zip(model_s.parameters(), model_p.parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
