"""DistributedOptimizer under mpiexec, beyond equivalence: no_sync, ops, predivide, groups,
zero gradients for unused parameters, skip_synchronize, schedulers, misuse errors."""
import copy

import pytest
import torch

import hpctrain.torch as hvd
from hpctrain import comm

RANKS = (2, 3)
TIMEOUT = 240

from torch_reference import B, N, R, STEPS, adam, cnn, data, distributed, local_grads, max_rel, mlp, reference, sgd  # noqa: E402,F401 (hvd.init() runs there)


def test_no_sync_accumulates():
    ref = reference("mlp", 2, sgd, passes=2)
    model = mlp()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    for s in range(2):
        x, y = data("mlp", s, N * B * 2)
        opt.zero_grad()
        with opt.no_sync():
            lo = R * B
            (torch.nn.functional.cross_entropy(model(x[lo:lo + B]), y[lo:lo + B]) / 2).backward()
        lo = (N + R) * B
        (torch.nn.functional.cross_entropy(model(x[lo:lo + B]), y[lo:lo + B]) / 2).backward()
        opt.step()
    assert max_rel(model, ref) <= 1e-10


def test_too_many_backward_passes_is_an_error():
    model = mlp()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    x, y = data("mlp", 0, B)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()  # the launched buckets complete on every rank


def test_compressed_gradients_match_math():
    """The averaged gradient with fp16 is the fp16 rounding of each rank's gradient, summed."""
    model = mlp().float()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    x, y = data("mlp", 0, N * B)
    xs, ys = x[R * B:(R + 1) * B].float(), y[R * B:(R + 1) * B]
    local = local_grads(model, xs, ys)
    torch.nn.functional.cross_entropy(model(xs), ys).backward()
    opt.synchronize()
    every = comm.allgather_object([g.half() for g in local])
    for i, p in enumerate(model.parameters()):
        expected = sum(e[i].float() for e in every) / N
        assert torch.allclose(p.grad, expected, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_op_and_predivide(op):
    model = mlp()
    kw = {"gradient_predivide_factor": 2.0} if op == hvd.Average else {}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters(),
                                   op=op, **kw)
    x, y = data("mlp", 0, N * B)
    xs, ys = x[R * B:(R + 1) * B], y[R * B:(R + 1) * B]
    local = local_grads(model, xs, ys)
    torch.nn.functional.cross_entropy(model(xs), ys).backward()
    opt.synchronize()
    every = comm.allgather_object(local)
    for i, p in enumerate(model.parameters()):
        total = sum(e[i] for e in every)
        expected = total if op == hvd.Sum else total / N
        assert torch.allclose(p.grad, expected, rtol=1e-12, atol=1e-14)


def test_unused_parameter_on_some_ranks_contributes_zeros():
    """Rank 0 does not use the second head; its gradient there counts as zeros."""
    torch.manual_seed(0)
    body, head_a, head_b = torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 1).double(), torch.nn.Linear(4, 1).double()
    model = torch.nn.ModuleDict({"body": body, "a": head_a, "b": head_b})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters(),
                                   fusion_threshold=0)
    x = torch.ones(2, 4, dtype=torch.float64) * (R + 1)
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    (twin["a"](twin["body"](x)).sum() + (twin["b"](twin["body"](x)).sum() if R != 0 else 0)).backward()
    local = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in twin.named_parameters()}
    out = head_a(body(x)).sum() + (head_b(body(x)).sum() if R != 0 else 0)
    out.backward()
    opt.step()
    every = comm.allgather_object(local)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, sum(e[n] for e in every) / N)


def test_grouped_buckets():
    ref = reference("mlp", 2, sgd)
    model = mlp()
    params = list(model.parameters())
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                   groups=[params[:2], params[4:]])
    for s in range(2):
        x, y = data("mlp", s, N * B)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[R * B:(R + 1) * B]), y[R * B:(R + 1) * B]).backward()
        opt.step()
    assert max_rel(model, ref) <= 1e-10
    opt2 = hvd.DistributedOptimizer(sgd(mlp().parameters()), groups=2)
    assert len(opt2.plan.buckets) == 2


def test_skip_synchronize_and_clipping():
    ref_model = mlp()
    ropt = sgd(ref_model.parameters())
    model = mlp()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    x, y = data("mlp", 0, N * B)
    torch.nn.functional.cross_entropy(ref_model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.01)
    ropt.step()
    torch.nn.functional.cross_entropy(model(x[R * B:(R + 1) * B]), y[R * B:(R + 1) * B]).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with opt.skip_synchronize():
        opt.step()
    assert max_rel(model, ref_model) <= 1e-10


def test_zero_grad_before_step_after_backward_is_an_error():
    model = mlp()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    x, y = data("mlp", 0, B)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.step()


def test_model_zero_grad_set_to_none_still_works():
    ref = reference("mlp", 3, sgd)
    model = mlp()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    for s in range(3):
        x, y = data("mlp", s, N * B)
        model.zero_grad(set_to_none=True)  # grads become None: the hooks copy the new ones in
        torch.nn.functional.cross_entropy(model(x[R * B:(R + 1) * B]), y[R * B:(R + 1) * B]).backward()
        opt.step()
    assert max_rel(model, ref) <= 1e-10


def test_lr_scheduler_and_state_dict():
    model = mlp()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = data("mlp", 0, B)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    sd = opt.state_dict()
    assert "state" in sd and len(sd["state"]) == 6


def test_different_options_across_ranks_is_an_error():
    if N == 1:
        return
    model = mlp()
    with pytest.raises(ValueError, match="different options"):
        hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                 op=hvd.Sum if R == 0 else hvd.Average)


def test_adasum_needs_a_power_of_two():
    # (Adasum itself: tests/mpi/test_adasum.py)
    if N & (N - 1):
        with pytest.raises(NotImplementedError, match="Adasum with non-power of 2"):
            hvd.DistributedOptimizer(sgd(mlp().parameters()), op=hvd.Adasum)
    else:
        opt = hvd.DistributedOptimizer(sgd(mlp().parameters()), op=hvd.Adasum)
        assert isinstance(opt, hvd.DistributedOptimizer)


def test_predivide_needs_average():
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(sgd(mlp().parameters()), op=hvd.Sum, gradient_predivide_factor=2.0)



@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_on_and_off(overlap):
    """With overlap, buckets are in flight before step(); without, none is; same result."""
    ref = reference("mlp", 2, sgd)
    model = mlp()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                   fusion_threshold=0, overlap=overlap)
    for s in range(2):
        x, y = data("mlp", s, N * B)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[R * B:(R + 1) * B]), y[R * B:(R + 1) * B]).backward()
        launched = sum(st.launched for st in opt._states)
        assert launched == (len(opt.plan.buckets) if overlap else 0)
        opt.step()
    assert max_rel(model, ref) <= 1e-10


def test_bad_arguments_on_one_rank_fail_every_rank():
    """Rank 0 alone passes duplicate names: rank 0 gets the duplicate error, the others an
    error naming rank 0 — nobody waits in a collective."""
    model = mlp()
    named = [("w", p) for p in model.parameters()] if R == 0 else list(model.named_parameters())
    expected = "duplicates" if R == 0 else "rank 0 rejected"
    with pytest.raises(ValueError, match=expected):
        hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named)


def test_bucket_allocator_buffers_hold_the_gradients():
    """A custom allocator (the hook for shared-memory buckets): its buffers are what is
    communicated, and every .grad is a view into one of them."""
    made = []

    def allocate(numel, dtype, device):
        buf = torch.full((numel,), float("nan"), dtype=dtype, device=device)  # garbage: must be zeroed
        made.append(buf)
        return buf

    ref = reference("mlp", 2, sgd)
    model = mlp()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                   bucket_allocator=allocate, fusion_threshold=512)
    assert len(made) == len(opt.plan.buckets) > 1
    for s in range(2):
        x, y = data("mlp", s, N * B)
        opt.zero_grad(set_to_none=(s == 0))
        torch.nn.functional.cross_entropy(model(x[R * B:(R + 1) * B]), y[R * B:(R + 1) * B]).backward()
        opt.step()
        ptrs = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in made]
        for p in model.parameters():
            assert any(lo <= p.grad.data_ptr() < hi for lo, hi in ptrs)
    assert max_rel(model, ref) <= 1e-10
