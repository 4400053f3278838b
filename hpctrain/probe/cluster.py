"""The cluster view: every rank's facts gathered and grouped node → ranks → devices.

``build_cluster_view`` is pure (a list of RankFacts in, a ClusterView out) so it is tested
in one process; ``gather_facts`` is the one collective (``comm.allgather_object``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .decide import BindingPlan, _ranges, check_cluster, check_rank, plan_binding
from .facts import GpuFacts, RankFacts


@dataclass(frozen=True)
class RankView:
    rank: int
    local_rank: int
    pid: int
    device: str
    gpu: Optional[int]
    threads: int


@dataclass(frozen=True)
class NodeView:
    hostname: str
    ranks: Tuple[RankView, ...]
    cpu_model: Optional[str]
    cores_physical: Optional[int]
    cores_logical: int
    numa_nodes: int
    memory_total: int
    memory_available: int
    gpus: Tuple[GpuFacts, ...]
    infiniband: Tuple[str, ...]


@dataclass(frozen=True)
class ClusterView:
    world_size: int
    nodes: Tuple[NodeView, ...]
    mpi: Optional[str]
    launcher: str
    slurm_job: Optional[str]
    warnings: Tuple[str, ...]

    @property
    def gpu_count(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)

    def to_dict(self) -> Dict[str, Any]:
        from .facts import _to_jsonable

        return _to_jsonable(asdict(self))


def build_cluster_view(all_facts: Sequence[RankFacts], plans: Optional[Sequence[BindingPlan]] = None) -> ClusterView:
    """Group facts by hostname (nodes in order of their lowest rank), with each rank's
    binding; warnings from every rank and from comparing them."""
    facts = sorted(all_facts, key=lambda f: f.rank)
    if not facts:
        raise ValueError("build_cluster_view: no facts")
    ranks_seen = [f.rank for f in facts]
    if len(set(ranks_seen)) != len(ranks_seen):
        raise ValueError(f"build_cluster_view: duplicate ranks {ranks_seen}")
    plans = list(plans) if plans is not None else [plan_binding(f) for f in facts]
    by_rank = {p.rank: p for p in plans}
    hosts: Dict[str, List[RankFacts]] = {}
    for f in facts:
        hosts.setdefault(f.hostname, []).append(f)
    nodes = []
    for host, members in hosts.items():
        first = members[0]
        views = tuple(RankView(f.rank, f.local_rank, f.pid, by_rank[f.rank].device if f.rank in by_rank else "?",
                               by_rank[f.rank].gpu if f.rank in by_rank else None,
                               by_rank[f.rank].threads if f.rank in by_rank else 0) for f in members)
        ib = tuple(f"{p.device}:{p.port} {p.state or '?'} {p.rate or ''}".strip() for p in first.network.infiniband)
        nodes.append(NodeView(host, views, first.cpus.model, first.cpus.physical, first.cpus.logical,
                              len(first.cpus.numa), first.memory.total, first.memory.available,
                              first.gpus.gpus, ib))
    # The same warning from several ranks (oversubscription is per node) is listed once.
    per_text: Dict[str, List[int]] = {}
    for f in facts:
        for w in check_rank(f):
            per_text.setdefault(w, []).append(f.rank)
    for p in plans:
        for w in p.warnings:
            per_text.setdefault(w, []).append(p.rank)
    seen = [f"{'rank' if len(r) == 1 else 'ranks'} {_ranges(r)}: {w}" for w, r in per_text.items()]
    seen.extend(check_cluster(facts))
    return ClusterView(len(facts), tuple(nodes), facts[0].mpi.library_version, facts[0].launcher.detail,
                       facts[0].slurm.job_id, tuple(seen))


def gather_facts(facts: RankFacts, comm_module=None) -> List[RankFacts]:
    """Every rank's facts on every rank (one allgather of small dicts)."""
    if comm_module is None:
        from hpctrain import comm as comm_module
    if not comm_module.is_initialized() or comm_module.size() == 1:
        return [facts]
    return [RankFacts.from_dict(d) for d in comm_module.allgather_object(facts.to_dict())]
