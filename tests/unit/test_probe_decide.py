"""Decisions from recorded facts: a CPU-only box (recorded on the dev VM), an 8×H100 node
and a node with 4×A100-80GB + 4×A100-40GB (written from the cards' specifications and
NVML's/SLURM's formats — no such machine was at hand)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hpctrain.probe import build_cluster_view
from hpctrain.probe.decide import (RankChoice, agree_batch, check_cluster, check_rank, global_batch_size,
                                   parse_bytes, plan_binding, plan_memory, rank_budget, scale_learning_rate)
from hpctrain.probe.facts import LauncherFacts, RankFacts

HERE = Path(__file__).parent / "probe_facts"
GiB = 1 << 30


def load(name):
    return [RankFacts.from_dict(d) for d in json.loads((HERE / name).read_text())]


def test_recorded_facts_round_trip():
    for name in ("cpu_box.json", "h100x8.json", "mixed_a100.json"):
        for f in load(name):
            assert RankFacts.from_dict(json.loads(json.dumps(f.to_dict()))) == f


# ------------------------------------------------------------------ CPU-only box
def test_cpu_box_binds_to_cpu_with_all_cores():
    (f,) = load("cpu_box.json")
    plan = plan_binding(f)
    assert plan.device == "cpu" and plan.gpu is None
    assert plan.threads == f.cpus.physical
    assert not plan.warnings


def test_cpu_box_two_ranks_split_cores_and_ram():
    (f,) = load("cpu_box.json")
    two = [dataclasses.replace(f, rank=r, local_rank=r, size=2, local_size=2) for r in range(2)]
    plans = [plan_binding(x) for x in two]
    assert [p.threads for p in plans] == [max(1, f.cpus.physical // 2)] * 2
    mem = plan_memory(two, plans)
    assert all(b.bytes == f.memory.available // 2 for b in mem.budgets)
    assert "same budget" in mem.message
    capped = plan_memory(two, plans, max_memory=2 * GiB)
    assert capped.smallest.bytes == 2 * GiB and "--max-memory" in capped.smallest.source


def test_cpu_box_oversubscribed_warns():
    (f,) = load("cpu_box.json")
    n = f.cpus.physical + 1
    plan = plan_binding(dataclasses.replace(f, local_size=n, size=n, local_rank=n - 1, rank=n - 1))
    assert plan.threads == 1
    assert any("oversubscribe" in w and "HINT" in w for w in plan.warnings)


def test_cuda_requested_on_cpu_box_is_an_error():
    (f,) = load("cpu_box.json")
    with pytest.raises(ValueError, match="(?s)no usable GPU.*HINT"):
        plan_binding(f, device="cuda")


def test_threads_precedence():
    (f,) = load("cpu_box.json")
    assert plan_binding(f, threads=7).threads == 7
    assert plan_binding(f, env={"OMP_NUM_THREADS": "3"}).threads == 3
    slurm = dataclasses.replace(f.slurm, job_id="1", cpus_per_task=1)
    assert plan_binding(dataclasses.replace(f, slurm=slurm)).threads == 1
    with pytest.raises(ValueError):
        plan_binding(f, threads=0)


# ------------------------------------------------------------------ 8×H100
def test_h100_node_one_gpu_per_local_rank():
    ranks = load("h100x8.json")
    plans = [plan_binding(f) for f in ranks]
    assert [p.device for p in plans] == [f"cuda:{i}" for i in range(8)]
    assert [p.gpu for p in plans] == list(range(8))
    assert all(p.threads == 56 // 8 for p in plans)
    assert not any(p.warnings for p in plans)
    mem = plan_memory(ranks, plans)
    assert {b.bytes for b in mem.budgets} == {80400 << 20}
    assert "same budget" in mem.message and "H100" in mem.budgets[0].source
    view = build_cluster_view(ranks, plans)
    assert len(view.nodes) == 1 and view.gpu_count == 8 and not view.warnings
    assert view.nodes[0].gpus[0].links[0] == (1, "NV18")


def test_h100_per_task_binding_by_slurm():
    """srun --gpus-per-task=1: each task sees one GPU as CUDA ordinal 0."""
    ranks = load("h100x8.json")
    for f in ranks:
        inv = dataclasses.replace(f.gpus, cuda_visible_devices=str(f.local_rank), visible=(f.local_rank,),
                                  torch_device_count=1)
        plan = plan_binding(dataclasses.replace(f, gpus=inv))
        assert plan.device == "cuda:0" and plan.gpu == f.local_rank and not plan.warnings


def test_h100_fewer_ranks_than_gpus_and_more_ranks_than_gpus():
    f = load("h100x8.json")[0]
    four = plan_binding(dataclasses.replace(f, local_size=4, size=4))
    assert four.device == "cuda:0" and any("idle" in w for w in four.warnings)
    r = dataclasses.replace(f, local_rank=11, rank=11, local_size=16, size=16)
    sixteen = plan_binding(r)
    assert sixteen.device == "cuda:3" and any("share" in w for w in sixteen.warnings)
    # the two ranks sharing a GPU split its memory
    ranks = [dataclasses.replace(f, local_rank=i, rank=i, local_size=16, size=16) for i in range(16)]
    mem = plan_memory(ranks, [plan_binding(x) for x in ranks])
    assert {b.bytes for b in mem.budgets} == {(80400 << 20) // 2}


def test_slurm_step_gpus_without_cuda_visible_devices():
    f = load("h100x8.json")[0]
    slurm = dataclasses.replace(f.slurm, step_gpus="4,5", job_gpus="4,5")
    g = dataclasses.replace(f, slurm=slurm, local_rank=1, local_size=2)
    plan = plan_binding(g)
    assert plan.device == "cuda:5" and any("SLURM allocated GPUs" in r for r in plan.reasons)


# ------------------------------------------------------------------ mixed memory
def test_mixed_node_smallest_gpu_wins_and_says_so():
    ranks = load("mixed_a100.json")
    plans = [plan_binding(f) for f in ranks]
    mem = plan_memory(ranks, plans)
    assert mem.smallest.rank == 4
    assert mem.smallest.bytes == (40960 - 600) << 20
    assert "smallest wins" in mem.message and "rank 4" in mem.message and "40GB" in mem.message
    assert "ranks 0-3" in mem.message and "ranks 4-7" in mem.message
    warnings = check_cluster(ranks)
    assert any("GPUs differ" in w and "smallest memory" in w for w in warnings)
    # the tuned batches per rank: the 40 GB cards fit half; every rank takes the minimum
    choices = [RankChoice(p.rank, "mixed01", p.device, b.bytes, 512 if p.rank < 4 else 248)
               for p, b in zip(plans, mem.budgets)]
    batch, why = agree_batch(choices)
    assert batch == 248
    assert "smallest wins" in why and "rank 4" in why


# ------------------------------------------------------------------ scaling, checks
def test_learning_rate_rules():
    lin = scale_learning_rate(0.1, 256, 8192, "linear", steps_per_epoch=100)
    assert lin.lr == pytest.approx(3.2) and lin.warmup_epochs == 5 and lin.warmup_steps == 500
    assert "Goyal" in lin.explanation and "warm up" in lin.explanation
    sq = scale_learning_rate(1e-3, 256, 1024, "sqrt")
    assert sq.lr == pytest.approx(2e-3)
    none = scale_learning_rate(0.1, 256, 1024, "none")
    assert none.lr == 0.1 and none.warmup_epochs == 0
    smaller = scale_learning_rate(0.1, 256, 64, "linear")
    assert smaller.lr == pytest.approx(0.025) and smaller.warmup_epochs == 0
    with pytest.raises(ValueError, match="unknown learning-rate rule"):
        scale_learning_rate(0.1, 256, 512, "cubic")
    with pytest.raises(ValueError):
        scale_learning_rate(-1, 256, 512)


def test_global_batch():
    assert global_batch_size(248, 8, 4) == 7936
    with pytest.raises(ValueError):
        global_batch_size(0, 8)


def test_singleton_trap_detected():
    """srun without --mpi=pmix and the PyPI Open MPI: N tasks that each see a world of 1."""
    f = load("h100x8.json")[3]
    mpi = dataclasses.replace(f.mpi, rank=0, size=1, local_rank=0, local_size=1)
    launcher = LauncherFacts("srun", "srun", (), 3, 8, 3, None)
    warnings = check_rank(dataclasses.replace(f, mpi=mpi, launcher=launcher))
    assert any("world of 1" in w and "--mpi=pmix" in w for w in warnings)


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * GiB
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5G") == 3 * GiB // 2
    assert parse_bytes("1000") == 1000
    for bad in ("", "2 GiBs", "-1G", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_budget_without_gpu_memory_needs_max_memory():
    f = load("h100x8.json")[0]
    gpus = tuple(dataclasses.replace(g, memory_free=None, memory_total=None) for g in f.gpus.gpus)
    g = dataclasses.replace(f, gpus=dataclasses.replace(f.gpus, gpus=gpus))
    plan = plan_binding(g)
    with pytest.raises(ValueError, match="--max-memory"):
        rank_budget(g, plan)
    assert rank_budget(g, plan, 10 * GiB).bytes == 10 * GiB


def test_cluster_view_two_nodes_and_mismatched_mpi():
    node1 = load("h100x8.json")
    node2 = [dataclasses.replace(f, hostname="gpu002", rank=f.rank + 8, size=16, pid=f.pid + 8) for f in node1]
    node1 = [dataclasses.replace(f, size=16) for f in node1]
    odd = dataclasses.replace(node2[-1], mpi=dataclasses.replace(node2[-1].mpi, library_version="MPICH Version: 4.1"))
    view = build_cluster_view(node1 + node2[:-1] + [odd])
    assert [n.hostname for n in view.nodes] == ["gpu001", "gpu002"]
    assert [r.rank for r in view.nodes[1].ranks] == list(range(8, 16))
    assert view.gpu_count == 16
    assert any("different MPI libraries" in w and "15" in w for w in view.warnings)
    with pytest.raises(ValueError, match="duplicate ranks"):
        build_cluster_view(node1 + node1)


def test_bind_applies_threads():
    import torch

    from hpctrain.probe import bind

    (f,) = load("cpu_box.json")
    before = torch.get_num_threads()
    try:
        plan = bind(f, threads=1, env={})
        assert plan.device == "cpu" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
