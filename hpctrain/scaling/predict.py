"""Step time, samples/s and scaling efficiency per node count, from a profile.

Overlap model: the runtime's bucket plan (:func:`hpctrain.torch.buckets.plan_buckets`, the
function ``DistributedOptimizer`` calls) groups the gradients; a bucket is ready when its last
gradient is (the profile's backward timeline). Buckets are all-reduced one at a time in plan
order, each starting when it is ready and the previous one is done. What ends after backward
is exposed:

    step = forward + max(backward, end of the last all-reduce) + optimizer

Efficiency is weak scaling (the batch per rank fixed): the 1-rank step over the N-rank step.
The model assumes communication does not slow the computation it overlaps (true of GPUs with
a copy engine; on CPUs the ranks' cores share it) and the same per-rank compute at every scale.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .fabrics import Link
from .model import ALGORITHMS, Machine, allreduce_time
from .profile import ITEMSIZE, Profile

__all__ = ["BucketTimes", "Prediction", "bucket_timeline", "overlap", "predict", "plan_scaling", "with_straggler",
           "DEFAULT_THRESHOLDS", "BEST"]

MiB = 1024 * 1024
DEFAULT_THRESHOLDS = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
BEST = "best"  # per bucket, the cheapest algorithm (what a tuned runtime would reach)


@dataclass(frozen=True)
class BucketTimes:
    """One bucket: elements, bytes per element, seconds after backward began when ready."""

    numel: int
    itemsize: int
    ready_s: float


@dataclass(frozen=True)
class Prediction:
    """One (node count, algorithm, threshold) point."""

    nodes: int
    ranks: int
    algorithm: str
    fusion_threshold: int
    buckets: int
    step_s: float
    comm_s: float
    exposed_s: float
    hidden_fraction: float
    samples_per_s: float
    efficiency: float

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)


def bucket_timeline(profile: Profile, threshold: int) -> List[BucketTimes]:
    """The runtime's buckets for ``threshold`` bytes, each with the time it becomes ready."""
    from hpctrain.torch.buckets import ParamSpec, plan_buckets  # torch: loaded on use only

    specs = [ParamSpec(p.name, tuple(p.shape), f"torch.{p.dtype}") for p in profile.params]
    ready = profile.ready_times() if profile.overlap else [profile.backward_s] * len(profile.params)
    out = []
    for b in plan_buckets(specs, threshold).buckets:
        itemsize = ITEMSIZE[b.dtype.replace("torch.", "")]
        out.append(BucketTimes(b.numel, itemsize, max(ready[s.index] for s in b.slots)))
    return out


def overlap(buckets: Sequence[BucketTimes], cost: Callable[[BucketTimes], float]) -> Tuple[float, float]:
    """(end of the last all-reduce, total all-reduce seconds), buckets sent one at a time in
    order, each when ready and the one before it is done."""
    end = total = 0.0
    for b in buckets:
        t = cost(b)
        end = max(end, b.ready_s) + t
        total += t
    return end, total


def _cost_fn(algorithm: str, m: Machine) -> Callable[[BucketTimes], float]:
    if algorithm == BEST:
        return lambda b: min(allreduce_time(a, b.numel, b.itemsize, m) for a in ALGORITHMS)
    return lambda b: allreduce_time(algorithm, b.numel, b.itemsize, m)


def predict(profile: Profile, m: Machine, algorithm: str, threshold: int,
            timeline: Optional[List[BucketTimes]] = None) -> Prediction:
    """One point: ``algorithm`` (one of ``model.ALGORITHMS`` or ``"best"``) for every bucket."""
    buckets = timeline if timeline is not None else bucket_timeline(profile, threshold)
    end, total = overlap(buckets, _cost_fn(algorithm, m)) if m.size > 1 else (0.0, 0.0)
    exposed = max(0.0, end - profile.backward_s)
    step = profile.compute_s + exposed
    return Prediction(
        nodes=m.nodes, ranks=m.size, algorithm=algorithm, fusion_threshold=threshold, buckets=len(buckets),
        step_s=step, comm_s=total, exposed_s=exposed,
        hidden_fraction=min(1.0, max(0.0, 1.0 - exposed / total)) if total > 0 else 1.0,
        samples_per_s=m.size * profile.batch_per_rank / step if step > 0 else float("inf"),
        efficiency=profile.compute_s / step if step > 0 else 1.0,
    )


def with_straggler(profile: Profile, slowdown: float) -> Profile:
    """The profile of the whole job when one rank computes ``slowdown`` (0.1: 10%) slower:
    every collective waits for its slowest member (``simulate.straggler_effect``: a late rank
    delays the all-reduce by its lateness for everyone), so the job runs at that rank's
    pace; its later-ready buckets leave more backward to hide communication behind."""
    if slowdown < 0:
        raise ValueError(f"straggler slowdown {slowdown} < 0; expected a fraction such as 0.1 for 10% slower")
    f = 1.0 + slowdown
    ready = profile.ready_times()
    params = tuple(replace(p, ready_s=r * f) for p, r in zip(profile.params, ready))
    return replace(profile, forward_s=profile.forward_s * f, backward_s=profile.backward_s * f,
                   optimizer_s=profile.optimizer_s * f, params=params)


def straggler_point(profile: Profile, m: Machine, best: Prediction, slowdown: float) -> Prediction:
    """``best``'s configuration with one rank ``slowdown`` slower; efficiency still against
    one rank at full speed."""
    slow = predict(with_straggler(profile, slowdown), m, best.algorithm, best.fusion_threshold)
    return replace(slow, efficiency=profile.compute_s / slow.step_s if slow.step_s > 0 else 1.0)


def machine_for(profile: Profile, nodes: int, ranks_per_node: int, inter: Optional[Link] = None) -> Machine:
    """The machine of ``nodes`` × ``ranks_per_node`` with the profile's links (``inter``
    overrides the profile's inter-node link)."""
    link = inter or profile.inter
    if link is None and nodes > 1:
        raise ValueError(f"profile {profile.name!r} has no inter-node link, needed for {nodes} nodes. "
                         "HINT: pass --fabric NAME (e.g. roce25, ib-hdr) or --link '2us,12.5GB/s', "
                         "or calibrate on two nodes")
    return Machine(nodes, ranks_per_node, profile.intra, link or profile.intra, profile.gamma_Bps,
                   profile.segment_bytes)


def _best(points: Sequence[Prediction]) -> Prediction:
    """The fastest point; a single algorithm unless mixing them per bucket (``best``) is
    faster by more than BEST_MARGIN: a plan names what to configure."""
    single = [p for p in points if p.algorithm != BEST]
    mixed = [p for p in points if p.algorithm == BEST]
    top = min(single or mixed, key=lambda p: p.step_s)
    if mixed and single:
        top_mixed = min(mixed, key=lambda p: p.step_s)
        if top_mixed.step_s < top.step_s * (1 - BEST_MARGIN):
            return top_mixed
    return top


BEST_MARGIN = 0.005


def plan_scaling(profile: Profile, nodes: Sequence[int], ranks_per_node: int,
                 algorithms: Sequence[str] = ALGORITHMS + (BEST,),
                 thresholds: Sequence[int] = DEFAULT_THRESHOLDS,
                 inter: Optional[Link] = None, straggler: float = 0.0) -> Dict[str, object]:
    """Every (node count, algorithm, threshold) point, and per node count the best one, the
    best at the profile's own threshold and (``straggler`` > 0) the best one's prediction
    with one rank that much slower."""
    thresholds = sorted(set(thresholds) | {profile.fusion_threshold})
    timelines = {t: bucket_timeline(profile, t) for t in thresholds}
    points: List[Prediction] = []
    summary = []
    for n in nodes:
        m = machine_for(profile, n, ranks_per_node, inter)
        here = [predict(profile, m, a, t, timelines[t]) for a in algorithms for t in thresholds]
        points.extend(here)
        best = _best(here)
        at_default = min((p for p in here if p.fusion_threshold == profile.fusion_threshold),
                         key=lambda p: p.step_s)
        row = {"nodes": n, "ranks": m.size, "best": best.to_dict(), "at_profile_threshold": at_default.to_dict()}
        if straggler > 0 and m.size > 1:
            row["with_straggler"] = straggler_point(profile, m, best, straggler).to_dict()
        summary.append(row)
    return {"profile": profile.name, "ranks_per_node": ranks_per_node, "single_rank_step_s": profile.compute_s,
            "straggler": straggler,
            "thresholds": thresholds, "algorithms": list(algorithms),
            "summary": summary, "points": [p.to_dict() for p in points]}
