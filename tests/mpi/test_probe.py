"""The probe under a real mpiexec: gathered facts and the cluster view, binding, and the
CPU batch-size tuner for real (a memory cap, exhaustive comparison, all ranks agree)."""
import math
import os
import sys
from pathlib import Path

import pytest

from hpctrain import comm
from hpctrain.probe import build_cluster_view, collect_facts, gather_facts, plan_binding, tune_batch_size
from hpctrain.probe.tuner import PinnedMallocThreshold, TrialRunner

RANKS = (1, 2)
TIMEOUT = 480

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.tune_wide import factory  # noqa: E402

comm.init()
N, R = comm.size(), comm.rank()
MiB = 1 << 20


def test_facts_gathered_on_every_rank():
    facts = collect_facts()
    assert (facts.rank, facts.size) == (R, N)
    assert facts.local_size == comm.local_size() and facts.local_rank == comm.local_rank()
    assert facts.launcher.kind == "mpiexec" and facts.launcher.env_size == N
    assert facts.mpi.implementation == "Open MPI"
    all_facts = gather_facts(facts)
    assert [f.rank for f in all_facts] == list(range(N))
    assert len({f.pid for f in all_facts}) == N
    view = build_cluster_view(all_facts)
    assert view.world_size == N
    assert sum(len(n.ranks) for n in view.nodes) == N
    node = [n for n in view.nodes if n.hostname == facts.hostname][0]
    assert R in [r.rank for r in node.ranks]
    assert all(r.device == "cpu" for n in view.nodes for r in n.ranks)


def test_binding_divides_cores():
    import dataclasses

    facts = collect_facts()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # the harness sets it: respected
        assert plan_binding(facts).threads == int(os.environ["OMP_NUM_THREADS"])
    facts = dataclasses.replace(facts, cpus=dataclasses.replace(facts.cpus, omp_num_threads=None))
    plan = plan_binding(facts, env={})
    cores = facts.cpus.physical or facts.cpus.logical
    assert plan.threads == max(1, cores // facts.local_size)
    if facts.local_size > cores:
        assert any("oversubscribe" in w for w in plan.warnings)


CAP = 48 * MiB  # rank 0; rank r gets CAP * (1 + r/2): the ranks disagree, the minimum must win


def test_cpu_tuner_within_10_percent_of_the_true_limit_and_ranks_agree():
    import torch

    torch.set_num_threads(1)
    target = factory()
    mine = int(CAP * (1 + R / 2))
    result = tune_batch_size(target.model_factory, target.make_batch, target.optimizer_factory, target.loss_fn,
                             base_lr=target.base_lr, base_batch=target.base_batch, lr_rule=target.lr_rule,
                             max_memory=mine, margin=0.1)
    # all ranks agree, on the minimum of what each found
    everyone = comm.allgather_object(result.per_device_batch)
    assert len(set(everyone)) == 1
    assert result.per_device_batch == min(c.batch for c in result.per_rank)
    assert [c.rank for c in result.per_rank] == list(range(N))
    assert result.global_batch == result.per_device_batch * N
    assert result.lr == pytest.approx(target.base_lr * math.sqrt(result.global_batch / target.base_batch))
    own = result.per_rank[R]
    assert own.budget == mine
    if N > 1:
        assert "smallest wins" in result.explanation or len({c.batch for c in result.per_rank}) == 1
    # the true limit, bracketed with the same runner: a step's peak memory grows with the batch
    # (every batch below one that fits fits), so the tuner is within 10% below and 3% above the
    # largest batch that fits exactly when `low` fits and `high` does not (a scan of every batch
    # up to the first that does not fit found the same, at ~10x the trials)
    low = max(1, math.ceil((own.batch - 1) / 1.03))  # fits => own.batch <= 1.03 * limit + 1
    high = math.floor(own.batch / 0.9) + 1           # does not fit => own.batch >= 0.9 * limit
    runner = TrialRunner(target, "cpu", mine, int(mine * 0.9))
    with PinnedMallocThreshold():
        runner.warm_up()
        assert runner(low).fits, f"rank {R}: batch {low} does not fit: the tuner's {own.batch} is too large"
        assert not runner(high).fits, f"rank {R}: batch {high} fits: the tuner's {own.batch} is too small"
    if R == 0:
        assert len(result.trials) <= math.ceil(math.log2(high - 1)) + 3, [(t.batch, t.outcome) for t in result.trials]
        print(f"\n[probe] rank 0: tuner {own.batch} in {len(result.trials)} trials; {low} fits, {high} does not\n"
              + result.explanation, flush=True)


def test_tuner_error_on_one_rank_reaches_all():
    """A model that breaks on one rank must fail every rank, not hang the others."""
    target = factory()

    def model_factory():
        if R == N - 1:
            raise RuntimeError("injected: model cannot be built on the last rank")
        return target.model_factory()

    with pytest.raises((RuntimeError,), match="injected"):
        tune_batch_size(model_factory, target.make_batch, target.optimizer_factory, target.loss_fn,
                        max_memory=CAP)


def test_nothing_fits_is_an_error_everywhere():
    target = factory()
    with pytest.raises(RuntimeError, match="does not fit.*HINT|does not fit"):
        tune_batch_size(target.model_factory, target.make_batch, target.optimizer_factory, target.loss_fn,
                        max_memory=1 * MiB)
