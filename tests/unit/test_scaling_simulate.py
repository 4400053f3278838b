"""The event-time simulation of the ring and hierarchical schedules agrees with the closed
form where the closed form holds (bandwidth-bound steps, cheap reduction, everyone on time)
and shows where it does not: the reduction hidden behind the next segment, latency hidden
behind the other rings at a shared port, a late rank, a slow link. Pure: no mpiexec."""
import pytest

from hpctrain.comm import plan
from hpctrain.scaling import simulate as sim
from hpctrain.scaling.fabrics import Link
from hpctrain.scaling.model import Machine, allreduce_time

INTRA = Link(2e-6, 20e9)
INTER = Link(1e-6, 23.75e9)  # ib-hdr


def machine(nodes, per_node, gamma=1e15, seg=512 * 1024):
    return Machine(nodes, per_node, INTRA, INTER, gamma, seg)


@pytest.mark.parametrize("algo", ["ring", "hierarchical"])
@pytest.mark.parametrize("nodes, per_node, numel", [(1, 4, 1 << 22), (4, 4, 1 << 24), (16, 8, 1 << 24), (3, 3, 10_000_001)])
def test_simulation_agrees_with_the_closed_form_where_it_holds(algo, nodes, per_node, numel):
    m = machine(nodes, per_node)
    got = sim.simulate(algo, numel, 4, m).time_s
    assert got == pytest.approx(allreduce_time(algo, numel, 4, m), rel=0.03)


def test_simulation_reaches_4096_ranks_and_agrees_there():
    m = machine(512, 8)
    got = sim.simulate("ring", 1 << 24, 4, m)
    assert got.finish_s.shape == (4096,)
    assert got.time_s == pytest.approx(allreduce_time("ring", 1 << 24, 4, m), rel=0.03)


def test_simulation_is_driven_by_the_runtimes_schedule(monkeypatch):
    calls = []
    real = plan.ring_schedule.__wrapped__
    monkeypatch.setattr(plan, "ring_schedule", lambda *a: calls.append(a) or real(*a))
    sim.simulate("ring", 1000, 4, machine(2, 2))
    assert calls == [(1000, 4, 0, 512 * 1024 // 4)]


def test_segments_hide_the_reduction_that_the_closed_form_adds():
    """With reduction as slow as the wire, the closed form adds it to every step; the runtime
    reduces one segment while the next is on the wire, and the simulation shows it."""
    m = machine(4, 4, gamma=INTER.bandwidth_Bps, seg=64 * 1024)
    closed = allreduce_time("ring", 1 << 24, 4, m)
    got = sim.simulate("ring", 1 << 24, 4, m).time_s
    assert got < 0.85 * closed


def test_tiny_segments_cost_one_alpha_each():
    """Small segments multiply the messages: the simulation (and the segment-aware closed form)
    pay one α each, which the textbook one-message-per-step form misses."""
    m_big, m_tiny = machine(8, 1, seg=1 << 30), machine(8, 1, seg=1024)
    numel = 1 << 20
    big = sim.simulate("ring", numel, 4, m_big).time_s
    tiny = sim.simulate("ring", numel, 4, m_tiny).time_s
    messages_per_step = numel * 4 // 8 // 1024
    assert tiny - big == pytest.approx(2 * 7 * (messages_per_step - 1) * INTER.alpha_s, rel=0.05)
    assert tiny == pytest.approx(allreduce_time("ring", numel, 4, m_tiny), rel=0.03)


def test_latency_hides_behind_the_other_rings_at_a_shared_port():
    """Hierarchical at many nodes with small slices: while one local rank pays its α the
    port carries another's bytes; the closed form adds the two."""
    m = machine(512, 8)
    assert sim.simulate("hierarchical", 1 << 22, 4, m).time_s < 0.9 * allreduce_time("hierarchical", 1 << 22, 4, m)


@pytest.mark.parametrize("algo", ["ring", "hierarchical"])
def test_one_late_rank_delays_everyone_by_its_lateness(algo):
    m = machine(8, 4)
    base = sim.simulate(algo, 1 << 22, 4, m)
    late = sim.straggler_effect(algo, 1 << 22, 4, m, delay_s=2e-3, rank=13)
    assert late == pytest.approx(2e-3, rel=0.02)
    start = [0.0] * m.size
    start[13] = 2e-3
    finish = sim.simulate(algo, 1 << 22, 4, m, start_s=start).finish_s
    # every rank waits, not only the late one (the others get only the first steps done early)
    assert finish.min() > base.time_s + 0.7 * 2e-3


def test_one_slow_link_sets_the_pace_of_the_whole_ring():
    m = machine(8, 1)
    numel = 1 << 24
    fast = sim.simulate("ring", numel, 4, m).time_s
    slow = sim.simulate("ring", numel, 4, m, slow_link=(3, Link(INTER.alpha_s, INTER.bandwidth_Bps / 2))).time_s
    assert slow == pytest.approx(2 * fast, rel=0.05)


def test_bad_start_list_is_refused():
    with pytest.raises(ValueError, match="4 entries for 8 ranks"):
        sim.simulate("ring", 100, 4, machine(2, 4), start_s=[0, 0, 0, 0])
    with pytest.raises(ValueError, match="valid: ring, hierarchical"):
        sim.simulate("tree", 100, 4, machine(2, 4))
