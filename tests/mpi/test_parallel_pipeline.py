"""Pipeline and hybrid DP × PP under mpiexec: S = 2 stages on 2 ranks, DP = 2 × PP = 2 on 4.

Gradients and updated weights equal single-process training on the same global batch (fp32,
≤ 1e-5 relative) for GPipe and 1F1B; runs are bitwise deterministic; 1F1B holds less
activation memory than GPipe for M ≫ S; bad input fails before any message; stage
checkpoints merge into the original model's state_dict."""
import os
import tempfile

import pytest
import torch

from hpctrain import comm
from hpctrain.parallel import PipelineModule, distributed_optimizer, merge_stage_checkpoints, save_stage_checkpoint
from hpctrain.parallel.checkpoint import load_stage_checkpoint
from hpctrain.parallel.partition import PartitionError

RANKS = (2, 4)
TIMEOUT = 480  # imports alone take ~1 min per rank on a loaded 2-core machine

comm.init()
R, N = comm.rank(), comm.size()
S = 2
DP = N // S
torch.set_num_threads(1)
B = 8  # rows per replica per step
STEPS = 2
TOL = 1e-5
CE = torch.nn.functional.cross_entropy


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def global_batch(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 10, generator=g), torch.randint(0, 3, (rows,), generator=g)


def reference(steps, rows_per_replica=B, lr=0.1):
    """One process, the whole global batch (DP × rows) per step. Returns (grads of step 0, model)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    first = None
    for s in range(steps):
        x, y = global_batch(s, DP * rows_per_replica)
        opt.zero_grad()
        CE(model(x), y).backward()
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return first, model


def pipelined(schedule, steps, micro_batches=4, rows_per_replica=B, lr=0.1, **kw):
    pipe = PipelineModule(mlp(), stages=S, micro_batches=micro_batches, schedule=schedule, **kw)
    opt = distributed_optimizer(pipe, torch.optim.SGD(pipe.parameters(), lr=lr, momentum=0.9))
    first, losses = None, []
    for s in range(steps):
        x, y = global_batch(s, DP * rows_per_replica)
        lo = pipe.replica * rows_per_replica
        opt.zero_grad()
        losses.append(float(pipe.train_step(x[lo:lo + rows_per_replica], y[lo:lo + rows_per_replica], CE)))
        if hasattr(opt, "synchronize"):
            opt.synchronize()  # average now, to look at the gradients before the step
        if first is None:
            first = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        _step(opt)
    return pipe, first, losses


def _step(opt):
    # the gradients were synchronized above (to inspect them); step without a second all-reduce
    if hasattr(opt, "skip_synchronize"):
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gradients_and_weights_equal_single_process(schedule):
    ref_grads, ref_model = reference(STEPS)
    pipe, grads, _ = pipelined(schedule, STEPS)
    ref_params = dict(ref_model.named_parameters())
    assert set(grads) == {n for n, _ in pipe.named_parameters()} and grads
    for n, g in grads.items():
        assert rel(g, ref_grads[n]) <= TOL, (schedule, n, rel(g, ref_grads[n]))
    for n, p in pipe.named_parameters():
        assert rel(p.detach(), ref_params[n].detach()) <= TOL, (schedule, n)
    # every stage together owns the whole model
    names = comm.allgather_object(sorted(grads))
    assert sorted(k for part in names for k in part) == sorted(
        [k for k in ref_grads] * DP)


def test_uneven_micro_batches_and_loss_value():
    """10 rows in 4 micro-batches (3, 3, 2, 2): each micro-batch loss is weighted by its rows."""
    ref_grads, _ = reference(1, rows_per_replica=10)
    pipe, grads, losses = pipelined("1f1b", 1, micro_batches=4, rows_per_replica=10)
    for n, g in grads.items():
        assert rel(g, ref_grads[n]) <= TOL
    # the returned loss is this replica's batch mean, on every stage
    x, y = global_batch(0, DP * 10)
    lo = pipe.replica * 10
    with torch.no_grad():
        expect = float(CE(mlp()(x[lo:lo + 10]), y[lo:lo + 10]))
    assert losses[0] == pytest.approx(expect, rel=1e-5)


def test_deterministic_across_runs():
    for schedule in ("gpipe", "1f1b"):
        a, _, la = pipelined(schedule, 2)
        b, _, lb = pipelined(schedule, 2)
        assert la == lb
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(p, q), (schedule, n)


def test_1f1b_holds_less_activation_memory_than_gpipe():
    M = 16  # M ≫ S
    stats = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = PipelineModule(mlp(), stages=S, micro_batches=M, schedule=schedule)
        x, y = global_batch(0, M * 4)
        pipe.train_step(x, y, CE)
        stats[schedule] = pipe.last_stats
    g, f = stats["gpipe"], stats["1f1b"]
    assert g.peak_in_flight == M
    assert f.peak_in_flight <= S
    assert 0 < f.peak_activation_bytes < g.peak_activation_bytes / 4, (f, g)
    # the bubble is measured and within [0, 1)
    assert 0.0 <= f.bubble_fraction < 1.0 and f.step_seconds > 0 and f.compute_seconds > 0


def _still_in_step():
    """After an error on every rank, a collective still matches: nothing was sent."""
    out = comm.allreduce(torch.tensor([1.0]), op="sum")
    assert float(out[0]) == N


def test_bad_input_fails_before_any_communication():
    with pytest.raises(ValueError, match="need at least"):
        PipelineModule(mlp(), stages=N + 1, micro_batches=2)
    _still_in_step()
    if N == 4:
        with pytest.raises(ValueError, match="not divisible"):
            PipelineModule(mlp(), stages=3, micro_batches=2)
        _still_in_step()
    with pytest.raises(PartitionError, match="cannot split a model of 1 layer"):
        PipelineModule(torch.nn.Sequential(torch.nn.Linear(2, 2)), stages=2, micro_batches=2)
    _still_in_step()
    with pytest.raises(PartitionError, match="out of range"):
        PipelineModule(mlp(), stages=2, micro_batches=2, split_points=[7])
    _still_in_step()
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        PipelineModule(mlp(), stages=2, micro_batches=2, schedule="zigzag")
    _still_in_step()
    with pytest.raises(ValueError, match="micro_batches"):
        PipelineModule(mlp(), stages=2, micro_batches=0)
    _still_in_step()
    with pytest.raises(ValueError, match="sample_input"):
        PipelineModule(mlp(), stages=2, micro_batches=2, balance="time")
    _still_in_step()


def test_explicit_split_and_time_balance_agree_across_ranks():
    pipe = PipelineModule(mlp(), stages=S, micro_batches=2, split_points=[5])
    assert pipe.plan.bounds == ((0, 5), (5, 7))
    pipe = PipelineModule(mlp(), stages=S, micro_batches=2, balance="time", sample_input=torch.randn(4, 10))
    plans = comm.allgather_object(pipe.plan.bounds)
    assert all(p == plans[0] for p in plans)
    assert pipe.plan.stages == S


def test_stage_checkpoints_merge_into_the_original_state_dict():
    pipe, _, _ = pipelined("1f1b", 2)
    directory = comm.broadcast_object(tempfile.mkdtemp(prefix="hpctrain-pp-") if R == 0 else None)
    path = save_stage_checkpoint(pipe, directory, extra={"step": 2})
    assert (path is not None) == (pipe.replica == 0)
    comm.barrier()
    merged = merge_stage_checkpoints(directory)
    _, ref_model = reference(2)
    ref = ref_model.state_dict()
    assert list(merged) == list(ref)
    for k in ref:
        assert rel(merged[k], ref[k]) <= TOL, k
    model = mlp()
    model.load_state_dict(merged)  # strict
    # resuming: a fresh pipeline loads its stage's file
    fresh = PipelineModule(mlp(), stages=S, micro_batches=4)
    assert load_stage_checkpoint(fresh, directory) == {"step": 2}
    for (n, p), (_, q) in zip(fresh.named_parameters(), pipe.named_parameters()):
        assert torch.equal(p, q), n
    comm.barrier()
    if R == 0:
        for f in os.listdir(directory):
            os.remove(os.path.join(directory, f))
        os.rmdir(directory)


def test_device_staging_path_matches():
    """device= moves activations through CPU wire buffers (the GPU path); on CPU it must agree."""
    ref_grads, _ = reference(1)
    _, grads, _ = pipelined("gpipe", 1, device="cpu")
    for n, g in grads.items():
        assert rel(g, ref_grads[n]) <= TOL, n


def test_bench_pipeline_runs(tmp_path_factory):
    import argparse
    import json

    from hpctrain.bench import pipeline as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = comm.broadcast_object(str(tmp_path_factory.mktemp("bench") / "pp.json") if R == 0 else None)
    args = parser.parse_args(["--stages", "2", "--micro-batches", "1,4", "--steps", "1", "--warmup", "0",
                              "--width", "16", "--layers", "2", "--batch", "8", "--json", out])
    assert bench.run(args) == 0
    if R == 0:
        records = json.load(open(out))
        assert [(r["schedule"], r["micro_batches"]) for r in records] == [("gpipe", 1), ("gpipe", 4), ("1f1b", 1),
                                                                           ("1f1b", 4)]
        for r in records:
            assert r["data_parallel"] == DP and r["samples_per_s"] > 0
            assert r["bubble_theory"] == pytest.approx((S - 1) / (r["micro_batches"] + S - 1))
            assert 0.0 <= r["bubble_measured"] <= 1.0


def test_evaluate_forward_only_matches_single_process():
    pipe = PipelineModule(mlp(), stages=S, micro_batches=3, schedule="1f1b")
    x, y = global_batch(5, DP * 9)
    lo = pipe.replica * 9
    got = float(pipe.evaluate(x[lo:lo + 9], y[lo:lo + 9], CE))
    with torch.no_grad():
        expect = float(CE(mlp()(x[lo:lo + 9]), y[lo:lo + 9]))
    assert got == pytest.approx(expect, rel=1e-5)
    assert all(p.grad is None for p in pipe.parameters())
    # training after evaluation reuses the agreed shapes and buffers
    pipe.train_step(x[lo:lo + 9], y[lo:lo + 9], CE)
    assert all(p.grad is not None for p in pipe.parameters())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_large_activations_use_rendezvous_sends_without_deadlock(schedule):
    """256 KiB messages (far above MPI's eager limit, so a send blocks until its receive is
    posted): stage 0's activation sends and stage 1's gradient sends cross in 1F1B's steady
    state; the planned message order must still complete, and match one process."""
    def wide():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(10, 16384), torch.nn.Tanh(), torch.nn.Linear(16384, 3))

    M, rows = 6, 24  # 4 rows × 16384 floats = 256 KiB per message
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(DP * rows, 10, generator=g), torch.randint(0, 3, (DP * rows,), generator=g)
    ref = wide()
    CE(ref(x), y).backward()
    pipe = PipelineModule(wide(), stages=S, micro_batches=M, schedule=schedule, split_points=[2])
    opt = distributed_optimizer(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1))
    lo = pipe.replica * rows
    pipe.train_step(x[lo:lo + rows], y[lo:lo + rows], CE)
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    ref_params = dict(ref.named_parameters())
    for n, p in pipe.named_parameters():
        assert rel(p.grad, ref_params[n].grad) <= TOL, n


def test_stage_starting_with_an_in_place_layer():
    """Stage 1 begins with ReLU(inplace=True): it must not modify the received leaf."""
    def net():
        torch.manual_seed(4)
        return torch.nn.Sequential(torch.nn.Linear(10, 12), torch.nn.ReLU(inplace=True), torch.nn.Linear(12, 3))

    x, y = global_batch(9, DP * 6)
    ref = net()
    CE(ref(x), y).backward()
    pipe = PipelineModule(net(), stages=S, micro_batches=2, split_points=[1])
    opt = distributed_optimizer(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1))
    lo = pipe.replica * 6
    pipe.train_step(x[lo:lo + 6], y[lo:lo + 6], CE)
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    ref_params = dict(ref.named_parameters())
    for n, p in pipe.named_parameters():
        assert rel(p.grad, ref_params[n].grad) <= TOL, n


def test_first_stage_without_parameters_and_unweighted_loss():
    """Stage 0 is only Flatten (its output needs no gradient); the loss is a sum normalised by
    the global batch (rows_weighted=False), as the runner uses it."""
    def net():
        torch.manual_seed(6)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(10, 3))

    rows = 6
    x, y = global_batch(11, DP * rows)
    ref = net()
    (CE(ref(x), y, reduction="sum") / (DP * rows)).backward()
    pipe = PipelineModule(net(), stages=S, micro_batches=3, split_points=[1])
    lo = pipe.replica * rows
    loss = pipe.train_step(x[lo:lo + rows], y[lo:lo + rows], lambda out, t: CE(out, t, reduction="sum") / rows,
                           rows_weighted=False)
    with torch.no_grad():
        expect = float(CE(net()(x[lo:lo + rows]), y[lo:lo + rows]))
    assert float(loss) == pytest.approx(expect, rel=1e-5)  # the micro-batch values summed
    assert (list(pipe.parameters()) == []) == pipe.is_first
    if not pipe.is_first:
        import hpctrain.torch as hvd

        # only the ranks of the last stage: its data-parallel group averages
        opt = hvd.DistributedOptimizer(torch.optim.SGD(pipe.parameters(), lr=0.1),
                                       named_parameters=pipe.named_parameters(),
                                       process_set=pipe.data_parallel_group, backward_passes_per_step=3)
        opt.synchronize()
        ref_params = dict(ref.named_parameters())
        for n, p in pipe.named_parameters():
            assert rel(p.grad, ref_params[n].grad) <= TOL, n
