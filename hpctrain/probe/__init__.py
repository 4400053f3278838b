"""hpctrain.probe — what hardware each rank has, where each rank runs, and which batch
size and learning rate fit it.

* ``collect_facts()`` → ``RankFacts`` (GPUs, CPUs, RAM, disks, MPI, launcher, SLURM, network)
* ``gather_facts(facts)`` / ``build_cluster_view(all_facts)`` → node → ranks → devices
* ``bind()`` → ``BindingPlan``: this rank's GPU and torch thread count, applied
* ``tune_batch_size(model_factory, make_batch, optimizer_factory, …)`` → ``TuneResult``

Decisions are pure functions in ``decide.py`` and ``search.py``; see docs/probe.md.
"""
from .binding import bind
from .cluster import ClusterView, build_cluster_view, gather_facts
from .collect import collect_facts, collect_gpus
from .decide import (BindingPlan, LR_RULES, agree_batch, format_bytes, parse_bytes, plan_binding, plan_memory,
                     scale_learning_rate)
from .facts import GpuFacts, GpuInventory, RankFacts
from .search import BatchSearch, SearchConfig, SearchResult, Trial, run_search
from .tuner import TuneResult, TuneTarget, tune_batch_size, tune_target

__all__ = [
    "collect_facts", "collect_gpus", "gather_facts", "build_cluster_view", "ClusterView", "bind", "BindingPlan",
    "plan_binding", "plan_memory", "agree_batch", "scale_learning_rate", "LR_RULES", "format_bytes",
    "parse_bytes", "RankFacts", "GpuFacts", "GpuInventory", "BatchSearch", "SearchConfig", "SearchResult",
    "Trial", "run_search", "TuneResult", "TuneTarget", "tune_batch_size", "tune_target",
]
