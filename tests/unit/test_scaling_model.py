"""The scaling model (hpctrain.scaling): link costs, closed-form all-reduce costs over the
runtime's ring schedule, the overlap of all-reduce with backward over the runtime's bucket
plan. Pure: no mpiexec."""
import math

import pytest

from hpctrain.comm import plan
from hpctrain.scaling import model, predict
from hpctrain.scaling.fabrics import FABRICS, Link, link_from_spec, parse_link_text
from hpctrain.scaling.model import Machine, allreduce_time, ring_time
from hpctrain.scaling.predict import BucketTimes, overlap
from hpctrain.scaling.profile import Param, Profile, profile_from_dict

INTRA = Link(2e-6, 20e9)
INTER = Link(5e-6, 10e9)


def machine(nodes, per_node, gamma=1e15, seg=1 << 40):
    return Machine(nodes, per_node, INTRA, INTER, gamma, seg)


# ----------------------------------------------------------------------------- fabrics
def test_named_fabrics_are_line_rate_times_efficiency():
    link = FABRICS["roce25"].link
    assert link.bandwidth_Bps == pytest.approx(25e9 / 8 * 0.92)
    assert link.alpha_s == pytest.approx(3e-6)
    assert FABRICS["ib-ndr"].link.bandwidth_Bps > FABRICS["ib-hdr"].link.bandwidth_Bps > FABRICS["eth25"].link.bandwidth_Bps
    assert link_from_spec("ib-hdr") == FABRICS["ib-hdr"].link
    assert link_from_spec({"fabric": "eth100"}) == FABRICS["eth100"].link


def test_links_from_numbers():
    for text, (alpha, bw) in (("2us,12.5GB/s", (2e-6, 12.5e9)), ("25us,25Gbit/s", (25e-6, 25e9 / 8))):
        link = parse_link_text(text)
        assert (link.alpha_s, link.bandwidth_Bps) == (pytest.approx(alpha), pytest.approx(bw))
    assert link_from_spec({"alpha_s": 1e-6, "bandwidth_Bps": 3e9}) == Link(1e-6, 3e9)


@pytest.mark.parametrize("bad", ["infiniband", "2us", "2 parsecs,1GB/s", {"alpha_s": 1.0}])
def test_bad_link_is_one_line_with_a_hint(bad):
    with pytest.raises(ValueError, match="HINT"):
        link_from_spec(bad)


# ----------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("ranks", [2, 3, 8, 64])
def test_ring_is_the_textbook_alpha_beta_gamma_form_for_one_segment_per_step(ranks):
    numel, itemsize, gamma = 64 * 1024 * ranks, 4, 5e9
    n = numel * itemsize
    expect = 2 * (ranks - 1) * (INTER.alpha_s + n / ranks / INTER.bandwidth_Bps) + (ranks - 1) * n / ranks / gamma
    assert ring_time(numel, itemsize, ranks, INTER, gamma, 1 << 40) == pytest.approx(expect, rel=1e-9)


def test_ring_counts_the_runtimes_segments(monkeypatch):
    """The cost walks plan.ring_schedule and plan.segments: a smaller segment adds one α per
    extra message of every step; the schedule is the runtime's, not a copy."""
    calls = []
    real = plan.ring_schedule.__wrapped__

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(plan, "ring_schedule", spy)
    model.ring_time.cache_clear()
    numel, ranks = 1 << 20, 4
    whole = ring_time(numel, 4, ranks, INTER, 1e15, 1 << 40)
    split = ring_time(numel, 4, ranks, INTER, 1e15, 64 * 1024)
    chunk_bytes = numel * 4 // ranks
    extra_messages = 2 * (ranks - 1) * (chunk_bytes // (64 * 1024) - 1)
    assert split - whole == pytest.approx(extra_messages * INTER.alpha_s, rel=1e-9)
    assert calls == [(numel, ranks, 0, (1 << 40) // 4), (numel, ranks, 0, 64 * 1024 // 4)]


def test_one_rank_costs_nothing_and_unknown_algorithm_is_refused():
    assert allreduce_time("ring", 1000, 4, machine(1, 1)) == 0.0
    with pytest.raises(ValueError, match="valid: ring, hierarchical"):
        allreduce_time("butterfly", 1000, 4, machine(2, 2))


def test_hierarchical_on_one_node_is_the_shared_memory_path():
    m = machine(1, 4, gamma=5e9)
    assert allreduce_time("hierarchical", 1 << 20, 4, m) == pytest.approx(
        model.shm_time(1 << 20, 4, 4, INTRA, 5e9))


def test_hierarchical_sends_a_slice_per_local_rank_through_the_shared_port():
    m = machine(8, 4)
    n = (1 << 24) * 4
    # bandwidth term: each node moves 2(N-1)/N of the buffer through its port, in four rings
    inter_bw = 2 * 7 / 8 * n / INTER.bandwidth_Bps
    inside = model.shm_time(1 << 24, 4, 4, INTRA, 1e15)
    got = allreduce_time("hierarchical", 1 << 24, 4, m)
    assert got == pytest.approx(inside + inter_bw + 2 * 7 * INTER.alpha_s, rel=1e-6)


def test_at_many_nodes_small_messages_favour_hierarchical_over_the_flat_ring():
    m = machine(256, 8)
    assert allreduce_time("hierarchical", 1 << 14, 4, m) < allreduce_time("ring", 1 << 14, 4, m) / 4


def test_machine_validates():
    with pytest.raises(ValueError, match="at least 1 node"):
        Machine(0, 1, INTRA, INTER, 1e9)
    with pytest.raises(ValueError, match="gamma"):
        Machine(1, 1, INTRA, INTER, 0)


# ----------------------------------------------------------------------------- overlap
def test_overlap_sends_buckets_in_order_when_ready():
    buckets = [BucketTimes(1, 4, 1.0), BucketTimes(1, 4, 1.5), BucketTimes(1, 4, 4.0)]
    end, total = overlap(buckets, lambda b: 1.0)
    # 1.0-2.0, 2.0-3.0 (waits for the first), 4.0-5.0 (waits until ready)
    assert (end, total) == (5.0, 3.0)


def _profile(**kw):
    params = tuple(Param(f"p{i}", (250_000,)) for i in range(8))
    base = dict(name="t", batch_per_rank=32, forward_s=0.01, backward_s=0.02, optimizer_s=0.002, params=params,
                intra=INTRA, inter=INTER, gamma_Bps=5e9, fusion_threshold=2_000_000)
    base.update(kw)
    return Profile(**base)


def test_timeline_comes_from_the_runtimes_bucket_plan(monkeypatch):
    import hpctrain.torch.buckets as bk

    seen = []
    real = bk.plan_buckets
    monkeypatch.setattr(bk, "plan_buckets", lambda specs, threshold: seen.append(threshold) or real(specs, threshold))
    prof = _profile()
    tl = predict.bucket_timeline(prof, 2_000_000)
    assert seen == [2_000_000]
    assert [b.numel for b in tl] == [500_000] * 4
    # unmeasured timeline: equal backward time per tensor, last registered ready first
    assert [b.ready_s for b in tl] == pytest.approx([0.005, 0.010, 0.015, 0.020])


def test_predict_one_rank_is_the_compute_and_efficiency_falls_with_nodes():
    prof = _profile()
    one = predict.predict(prof, predict.machine_for(prof, 1, 1), "ring", prof.fusion_threshold)
    assert one.step_s == pytest.approx(prof.compute_s) and one.efficiency == 1.0 and one.comm_s == 0
    preds = [predict.predict(prof, predict.machine_for(prof, n, 4), "ring", prof.fusion_threshold)
             for n in (1, 4, 64)]
    for p in preds:  # efficiency is the one-rank compute over the predicted step
        assert p.efficiency == pytest.approx(prof.compute_s / p.step_s)
    steps = [p.step_s for p in preds]
    # more nodes: a longer ring over the network, so strictly longer steps beyond one node
    assert prof.compute_s <= steps[0] < steps[1] < steps[2]
    assert preds[2].comm_s > preds[1].comm_s > 0


def test_exposed_communication_is_what_ends_after_backward():
    prof = _profile(backward_s=1e-6)  # nothing to hide behind
    m = predict.machine_for(prof, 4, 2)
    p = predict.predict(prof, m, "ring", prof.fusion_threshold)
    assert p.exposed_s == pytest.approx(p.comm_s, rel=1e-3) and p.hidden_fraction < 0.01
    assert p.samples_per_s == pytest.approx(8 * 32 / p.step_s)


def test_plan_scaling_picks_a_threshold_and_algorithm_per_node_count():
    prof = _profile()
    res = predict.plan_scaling(prof, [1, 2, 16], 4, thresholds=[1 << 20, 16 << 20])
    assert [r["nodes"] for r in res["summary"]] == [1, 2, 16]
    assert res["thresholds"] == sorted({1 << 20, 16 << 20, 2_000_000})
    for row in res["summary"]:
        best = row["best"]
        assert best["step_s"] == min(p["step_s"] for p in res["points"] if p["nodes"] == row["nodes"]) or \
            best["algorithm"] != "best"
        assert best["fusion_threshold"] in res["thresholds"]


def test_many_nodes_without_an_inter_node_link_says_how_to_give_one():
    with pytest.raises(ValueError, match="HINT: pass --fabric"):
        predict.machine_for(_profile(inter=None), 2, 1)


# ----------------------------------------------------------------------------- profile
def test_profile_round_trips_and_accepts_synthetic_gradients():
    prof = _profile()
    again = profile_from_dict(prof.to_dict())
    assert again == prof
    synth = profile_from_dict({"batch_per_rank": 8, "compute": {"backward_s": 0.1},
                               "gradients": {"numel": 10, "tensors": 3}})
    assert [p.numel for p in synth.params] == [4, 3, 3] and synth.gradient_bytes == 40
    assert synth.inter is None


@pytest.mark.parametrize("data, match", [
    ({"batch_per_rank": 8, "compute": {"backward_s": 0.1}}, "neither 'parameters' nor 'gradients'"),
    ({"batch_per_rank": 8, "gradients": {"numel": 1}}, "missing key 'compute'"),
    ({"batch_per_rank": 8, "compute": {"backward_s": 0.1}, "gradients": {"numel": 1}, "colour": 1}, "unknown keys"),
])
def test_bad_profile_names_the_problem(data, match):
    with pytest.raises(ValueError, match=match):
        profile_from_dict(data)


def test_load_profile_missing_file_says_how_to_make_one(tmp_path):
    from hpctrain.scaling.profile import load_profile

    with pytest.raises(ValueError, match="hpctrain bench calibrate"):
        load_profile(tmp_path / "nope.json")
    assert math.isfinite(_profile().compute_s)


def test_without_overlap_every_bucket_waits_for_the_end_of_backward():
    tl = predict.bucket_timeline(_profile(overlap=False), 2_000_000)
    assert [b.ready_s for b in tl] == [0.02] * 4
    prof = _profile(overlap=False)
    p = predict.predict(prof, predict.machine_for(prof, 2, 2), "ring", prof.fusion_threshold)
    assert p.exposed_s == pytest.approx(p.comm_s) and p.hidden_fraction == pytest.approx(0.0, abs=1e-9)


def test_one_slow_rank_sets_the_pace_of_every_rank():
    prof = _profile(backward_s=0.2)  # enough backward to hide the all-reduce behind
    m = predict.machine_for(prof, 4, 2)
    base = predict.predict(prof, m, "ring", prof.fusion_threshold)
    res = predict.plan_scaling(prof, [1, 4], 2, algorithms=["ring"], thresholds=[prof.fusion_threshold],
                               straggler=0.25)
    slow = res["summary"][1]["with_straggler"]
    # the whole job computes at the slow rank's pace; the all-reduce still hides
    assert slow["step_s"] == pytest.approx(base.step_s + 0.25 * prof.compute_s, rel=1e-6)
    assert slow["efficiency"] == pytest.approx(prof.compute_s / slow["step_s"])
    with pytest.raises(ValueError, match="fraction"):
        predict.with_straggler(prof, -0.1)
