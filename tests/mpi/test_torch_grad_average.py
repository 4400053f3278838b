"""op=Average as "divide on the way into the bucket, then sum": after synchronize() every
rank's .grad is the mean of the ranks' gradients, whichever way the gradients reached the
bucket (fresh tensors copied in, accumulated in place, several backward passes, a parameter
without a gradient), and the wire op says so."""
import pytest
import torch

import hpctrain.torch as hvd
from hpctrain import comm

RANKS = (2, 3)
TIMEOUT = 180

hvd.init()
R, N = hvd.rank(), hvd.size()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 3))


def local_grads(m, passes, step):
    """This rank's summed gradient of ``passes`` backward passes (no communication)."""
    ref = model()
    ref.load_state_dict(m.state_dict())
    for k in range(passes):
        g = torch.Generator().manual_seed(1000 * step + 10 * R + k)
        torch.nn.functional.cross_entropy(ref(torch.randn(4, 16, generator=g)),
                                          torch.randint(0, 3, (4,), generator=g)).backward()
    return [p.grad.clone() for p in ref.parameters()]


def expected_mean(m, passes, step):
    mine = torch.cat([g.reshape(-1) for g in local_grads(m, passes, step)])
    return comm.allreduce(mine, op="sum") / N


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("overlap", [True, False])
def test_grad_after_synchronize_is_the_mean(set_to_none, passes, overlap):
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                   backward_passes_per_step=passes, fusion_threshold=512, overlap=overlap)
    for step in range(3):
        want = expected_mean(m, passes, step)
        opt.zero_grad(set_to_none=set_to_none)
        for k in range(passes):
            g = torch.Generator().manual_seed(1000 * step + 10 * R + k)
            torch.nn.functional.cross_entropy(m(torch.randn(4, 16, generator=g)),
                                              torch.randint(0, 3, (4,), generator=g)).backward()
        opt.synchronize()
        got = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (step, (got - want).abs().max())
        with opt.skip_synchronize():
            opt.step()
    if N > 1:
        assert all(op == "sum" for op in opt.bucket_ops)
        assert len(opt.bucket_ops) > 1


def test_parameter_without_gradient_on_some_ranks_averages_with_zeros():
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    ref = model()
    ref(x).sum().backward()
    rank0_grad = comm.broadcast(ref[4].weight.grad.clone(), root=0)
    opt.zero_grad()
    out = m(x) if R == 0 else m[0:2](x).sum(dim=1, keepdim=True).expand(4, 3)  # ranks > 0: no grad for m[4]
    out.sum().backward()
    opt.synchronize()
    assert torch.allclose(m[4].weight.grad, rank0_grad / N, rtol=1e-6, atol=1e-7)
    with opt.skip_synchronize():
        opt.step()


@pytest.mark.parametrize("kwargs,want", [
    ({"op": hvd.Sum}, "sum"),
    ({"op": hvd.Max}, "max"),
    ({"compression": hvd.Compression.fp16}, "avg"),
    ({"gradient_predivide_factor": 2.0}, "sum"),
])
def test_wire_op_per_option(kwargs, want):
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                   **kwargs)
    assert opt.bucket_ops == [want] * len(opt.plan.buckets)
