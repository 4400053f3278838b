"""Partition planner, hybrid layout and checkpoint merge — pure, no MPI."""
from __future__ import annotations

import collections
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hpctrain.parallel.checkpoint import CheckpointError, main as checkpoint_main, merge_stage_checkpoints
from hpctrain.parallel.hybrid import HybridLayout, check_world
from hpctrain.parallel.partition import (PartitionError, PartitionPlan, balance, brute_force_best, plan_partition,
                                         split_rows)
from hpctrain.parallel.pipeline import parameter_costs, sequence_layers


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 9))
def test_balance_is_optimal_contiguous_and_complete(costs, stages):
    if stages > len(costs):
        with pytest.raises(PartitionError, match="at least one layer"):
            balance(costs, stages)
        return
    plan = balance(costs, stages)
    assert plan.stages == stages and plan.num_layers == len(costs)
    assert all(n >= 1 for n in plan.sizes)
    covered = [i for s in range(stages) for i in plan.layers(s)]
    assert covered == list(range(len(costs)))
    assert max(plan.costs) == pytest.approx(brute_force_best(costs, stages))
    assert balance(costs, stages) == plan  # deterministic


def test_balance_examples():
    assert balance([1, 1, 1, 1], 2).bounds == ((0, 2), (2, 4))
    assert balance([10, 0, 0, 10], 2).bounds == ((0, 2), (2, 4))  # ties: fewest layers in the biggest stage
    assert balance([5, 1, 1, 1, 1, 1], 2).bounds == ((0, 1), (1, 6))
    assert balance([3], 1).bounds == ((0, 1),)
    plan = balance([4, 4, 4, 4], 4)
    assert plan.split_points == (1, 2, 3) and plan.imbalance == 1.0
    assert "stage 1: layers 1-1" in plan.describe()


def test_explicit_splits_and_sizes():
    plan = plan_partition([1] * 6, 3, split_points=[2, 5])
    assert plan.bounds == ((0, 2), (2, 5), (5, 6))
    assert plan.stage_of_layer(4) == 1
    assert plan_partition([1] * 6, 3, sizes=[1, 1, 4]).bounds == ((0, 1), (1, 2), (2, 6))
    with pytest.raises(PartitionError, match="out of range"):
        plan_partition([1] * 6, 3, split_points=[2, 6])
    with pytest.raises(PartitionError, match="out of range"):
        plan_partition([1] * 6, 2, split_points=[0])
    with pytest.raises(PartitionError, match="strictly increasing"):
        plan_partition([1] * 6, 3, split_points=[3, 3])
    with pytest.raises(PartitionError, match="need 2 split point"):
        plan_partition([1] * 6, 3, split_points=[3])
    with pytest.raises(PartitionError, match="sum to 5 layers but the model has 6"):
        plan_partition([1] * 6, 2, sizes=[2, 3])
    with pytest.raises(PartitionError, match="cannot split a model of 2 layer"):
        plan_partition([1, 1], 3)
    with pytest.raises(PartitionError, match="integer"):
        plan_partition([1, 1], 0)
    with pytest.raises(PartitionError, match="non-empty"):
        PartitionPlan(4, ((0, 2), (2, 2), (2, 4)))
    with pytest.raises(PartitionError, match="cover"):
        PartitionPlan(5, ((0, 2), (2, 4)))


def test_split_rows():
    assert split_rows(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert split_rows(8, 8)[-1] == (7, 8)
    with pytest.raises(ValueError, match="cannot be split into 4 micro-batches"):
        split_rows(3, 4)


def test_layers_and_costs_from_models():
    model = torch.nn.Sequential(collections.OrderedDict(
        [("embed", torch.nn.Linear(4, 8)), ("act", torch.nn.ReLU()), ("head", torch.nn.Linear(8, 2))]))
    layers = sequence_layers(model)
    assert [n for n, _ in layers] == ["embed", "act", "head"]
    assert parameter_costs(layers) == [40.0, 0.0, 18.0]
    assert [n for n, _ in sequence_layers([torch.nn.Linear(1, 1), torch.nn.Tanh()])] == ["0", "1"]
    with pytest.raises(TypeError, match="nn.Sequential"):
        sequence_layers(torch.nn.Linear(2, 2))


def test_hybrid_layout():
    lay = HybridLayout(8, 4)
    assert lay.data_parallel == 2
    assert [lay.stage_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [lay.replica_of(r) for r in range(8)] == [0, 1] * 4
    assert lay.pipeline_ranks(1) == (1, 3, 5, 7)
    assert lay.data_parallel_ranks(2) == (4, 5)
    for r in range(8):
        assert lay.rank_of(lay.stage_of(r), lay.replica_of(r)) == r
    # every rank in exactly one pipeline and one DP group
    pipes = sorted(r for d in range(2) for r in lay.pipeline_ranks(d))
    dps = sorted(r for s in range(4) for r in lay.data_parallel_ranks(s))
    assert pipes == dps == list(range(8))
    with pytest.raises(ValueError, match="need at least 4 ranks"):
        check_world(2, 4)
    with pytest.raises(ValueError, match="not divisible by the 2 pipeline stages"):
        check_world(3, 2)
    with pytest.raises(ValueError, match="integer"):
        check_world(4, 0)


def _stage(stage, stages, sd, split=(2,)):
    return {"format": "hpctrain.pipeline-stage/1", "stage": stage, "stages": stages, "layers": [],
            "split_points": list(split), "state_dict": collections.OrderedDict(sd)}


def test_merge_stage_checkpoints(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    full = model.state_dict()
    s0 = {k: v for k, v in full.items() if k.startswith("0.")}
    s1 = {k: v for k, v in full.items() if k.startswith("2.")}
    merged = merge_stage_checkpoints([_stage(1, 2, s1), _stage(0, 2, s0)])
    assert list(merged) == list(full)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    fresh.load_state_dict(merged)  # strict: an ordinary state_dict of the original model
    with pytest.raises(CheckpointError, match=r"stages \[1\] of 2 are missing"):
        merge_stage_checkpoints([_stage(0, 2, s0)])
    with pytest.raises(CheckpointError, match="appears twice"):
        merge_stage_checkpoints([_stage(0, 2, s0), _stage(0, 2, s0)])
    with pytest.raises(CheckpointError, match="different sizes"):
        merge_stage_checkpoints([_stage(0, 2, s0), _stage(1, 3, s1)])
    with pytest.raises(CheckpointError, match="different splits"):
        merge_stage_checkpoints([_stage(0, 2, s0), _stage(1, 2, s1, split=(1,))])
    with pytest.raises(CheckpointError, match="more than one stage"):
        merge_stage_checkpoints([_stage(0, 2, s0), _stage(1, 2, s0)])
    # the CLI over a directory
    for st_ in (_stage(0, 2, s0), _stage(1, 2, s1)):
        torch.save(st_, tmp_path / f"stage-{st_['stage']:03d}-of-002.pt")
    out = tmp_path / "model.pt"
    assert checkpoint_main(["merge", str(tmp_path), "-o", str(out)]) == 0
    assert list(torch.load(out)) == list(full)
    os.remove(tmp_path / "stage-001-of-002.pt")
    assert checkpoint_main(["merge", str(tmp_path), "-o", str(out)]) == 2


def test_parallel_config():
    from hpctrain.parallel.config import ParallelConfig

    cfg = ParallelConfig.from_dict({"pipeline_stages": 2, "micro_batches": 8, "schedule": "1F1B"})
    assert cfg.schedule == "1f1b" and cfg.enabled and cfg.to_dict()["micro_batches"] == 8
    assert not ParallelConfig.from_dict(None).enabled
    with pytest.raises(ValueError, match="unknown key.*'stages'.*valid: pipeline_stages"):
        ParallelConfig.from_dict({"stages": 2})
    with pytest.raises(ValueError, match="micro_batches must be an integer"):
        ParallelConfig.from_dict({"pipeline_stages": 2, "micro_batches": 0})
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        ParallelConfig.from_dict({"schedule": "zigzag"})
    with pytest.raises(ValueError, match="split_points needs 1 entries"):
        ParallelConfig.from_dict({"pipeline_stages": 2, "split_points": [1, 2]})
    with pytest.raises(ValueError, match="not both"):
        ParallelConfig.from_dict({"pipeline_stages": 2, "split_points": [1], "sizes": [1, 1]})
