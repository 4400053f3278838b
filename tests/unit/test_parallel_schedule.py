"""Pipeline schedules as pure plans: order per stage, cross-stage dependencies, blocking-send
deadlock freedom, in-flight activation bounds and the bubble."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from hpctrain.parallel.schedule import (BWD, FWD, RECV_ACT, RECV_GRAD, SCHEDULES, SEND_ACT, SEND_GRAD,
                                        DeadlockError, Op, Program, Schedule, ScheduleError, bubble_fraction,
                                        check_stage_order, in_flight_profile, lower, make_program, make_schedule,
                                        normalize_schedule, one_f_one_b_actions, simulate)

SIZES = [(s, m) for s in range(1, 7) for m in range(1, 13)]


@pytest.mark.parametrize("kind", SCHEDULES)
def test_every_micro_batch_forward_before_backward(kind):
    for S, M in SIZES:
        sched = make_schedule(kind, S, M)
        for s in range(S):
            acts = sched.actions[s]
            assert sorted(acts) == sorted([("fwd", m) for m in range(M)] + [("bwd", m) for m in range(M)])
            for m in range(M):
                assert acts.index(("fwd", m)) < acts.index(("bwd", m))


@pytest.mark.parametrize("kind", SCHEDULES)
def test_programs_complete_under_blocking_sends_and_match_the_bubble(kind):
    for S, M in SIZES:
        prog = make_program(kind, S, M)
        for fwd_t, bwd_t in ((1, 1), (1, 2)):
            res = simulate(prog, fwd_t, bwd_t)
            assert res.bubble_fraction == pytest.approx(bubble_fraction(S, M), abs=1e-12), (S, M, fwd_t, bwd_t)
            assert res.busy == tuple([M * (fwd_t + bwd_t)] * S)


def test_in_flight_activations():
    """1F1B holds at most min(S − s, M) ≤ S micro-batches on stage s; GPipe holds all M."""
    for S, M in SIZES:
        g = make_schedule("gpipe", S, M)
        f = make_schedule("1f1b", S, M)
        for s in range(S):
            assert g.peak_in_flight(s) == M
            assert f.peak_in_flight(s) == min(S - s, M) <= S
        gs, fs = simulate(lower(g)), simulate(lower(f))
        assert gs.peak_in_flight == tuple([M] * S)
        assert max(fs.peak_in_flight) <= min(S, M)
        if M > S:
            assert max(fs.peak_in_flight) < max(gs.peak_in_flight)


def test_program_dependencies_across_stages():
    """Every stage's recv has the matching send on the neighbour, in the same order per channel."""
    for kind in SCHEDULES:
        prog = make_program(kind, 4, 7)
        for s, ops in enumerate(prog.ops):
            sends_fwd = [o.micro_batch for o in ops if o.kind == SEND_ACT]
            if s + 1 < 4:
                recvs = [o.micro_batch for o in prog.ops[s + 1] if o.kind == RECV_ACT]
                assert sends_fwd == recvs == list(range(7))
            sends_bwd = [o.micro_batch for o in ops if o.kind == SEND_GRAD]
            if s > 0:
                recvs = [o.micro_batch for o in prog.ops[s - 1] if o.kind == RECV_GRAD]
                assert sends_bwd == recvs
            # compute ops appear in the schedule's order
            compute = [("fwd" if o.kind == FWD else "bwd", o.micro_batch) for o in ops if o.kind in (FWD, BWD)]
            assert tuple(compute) == prog.schedule.actions[s]
            # a stage receives its input before computing with it, and sends only what it computed
            done = set()
            got = set()
            for o in ops:
                if o.kind in (RECV_ACT, RECV_GRAD):
                    got.add((o.kind, o.micro_batch))
                elif o.kind == FWD:
                    assert s == 0 or (RECV_ACT, o.micro_batch) in got
                    done.add(("fwd", o.micro_batch))
                elif o.kind == BWD:
                    assert s == 3 or (RECV_GRAD, o.micro_batch) in got
                    done.add(("bwd", o.micro_batch))
                elif o.kind == SEND_ACT:
                    assert ("fwd", o.micro_batch) in done
                elif o.kind == SEND_GRAD:
                    assert ("bwd", o.micro_batch) in done


def test_naive_1f1b_ordering_deadlocks_and_the_simulator_says_so():
    """Send-immediately-after-compute 1F1B deadlocks under blocking sends (two neighbours sending
    to each other); the simulator must catch it — this is what lower() avoids."""
    S3 = 3
    sched3 = make_schedule("1f1b", S3, 6)
    ops3 = []
    for s in range(S3):
        prog = []
        for kind, m in sched3.actions[s]:
            if kind == "fwd":
                if s > 0:
                    prog.append(Op(RECV_ACT, m, s - 1))
                prog.append(Op(FWD, m))
                if s < S3 - 1:
                    prog.append(Op(SEND_ACT, m, s + 1))
            else:
                if s < S3 - 1:
                    prog.append(Op(RECV_GRAD, m, s + 1))
                prog.append(Op(BWD, m))
                if s > 0:
                    prog.append(Op(SEND_GRAD, m, s - 1))
        ops3.append(tuple(prog))
    with pytest.raises(DeadlockError):
        simulate(Program(sched3, tuple(ops3)))
    simulate(lower(sched3))  # the lowered one completes


def test_simulator_detects_mismatched_messages():
    sched = make_schedule("gpipe", 2, 2)
    good = lower(sched)
    s0 = list(good.ops[0])
    i, j = [k for k, o in enumerate(s0) if o.kind == SEND_ACT]
    s0[i], s0[j] = s0[j], s0[i]
    with pytest.raises(DeadlockError, match="wrong micro-batch"):
        simulate(Program(sched, (tuple(s0), good.ops[1])))


def test_unsatisfiable_dependencies_are_reported():
    # stage 1 wants micro-batch 1 first, stage 0 produces 0 first; under blocking sends that cannot work
    acts0 = (("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1))
    acts1 = (("fwd", 1), ("bwd", 1), ("fwd", 0), ("bwd", 0))
    # lower() defers sends, so it can still order them: acts1 receives 1 before 0 — the sends go out
    # in FIFO order per channel, so this is stuck
    with pytest.raises(ScheduleError, match="cannot be satisfied"):
        lower(Schedule("custom", 2, 2, (acts0, acts1)))


def test_bubble_formula():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert bubble_fraction(4, 13) == pytest.approx(3 / 16)
    with pytest.raises(ValueError):
        bubble_fraction(0, 4)
    with pytest.raises(ValueError):
        bubble_fraction(2, 0)


def test_1f1b_shape():
    assert one_f_one_b_actions(0, 3, 4) == (("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 0), ("fwd", 3), ("bwd", 1),
                                           ("bwd", 2), ("bwd", 3))
    assert one_f_one_b_actions(2, 3, 4) == (("fwd", 0), ("bwd", 0), ("fwd", 1), ("bwd", 1), ("fwd", 2), ("bwd", 2),
                                           ("fwd", 3), ("bwd", 3))
    # M < S: the warm-up is capped by M
    assert one_f_one_b_actions(0, 4, 2) == (("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1))


def test_names_and_bad_input():
    assert normalize_schedule("1F1B") == "1f1b"
    assert normalize_schedule("GPipe") == "gpipe"
    assert normalize_schedule("pipedream-flush") == "1f1b"
    with pytest.raises(ValueError, match="valid: gpipe, 1f1b"):
        normalize_schedule("interleaved")
    with pytest.raises(ValueError):
        make_schedule("gpipe", 2, 0)
    with pytest.raises(ScheduleError, match="before its forward"):
        check_stage_order((("bwd", 0), ("fwd", 0)), 1)
    with pytest.raises(ScheduleError, match="lack"):
        check_stage_order((("fwd", 0),), 1)
    assert in_flight_profile((("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1))) == [1, 2, 1, 0]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SCHEDULES), st.integers(1, 10), st.integers(1, 40))
def test_property_lowered_programs_never_deadlock(kind, S, M):
    res = simulate(make_program(kind, S, M))
    assert res.bubble_fraction == pytest.approx(bubble_fraction(S, M), abs=1e-12)
    if kind == "1f1b":
        assert max(res.peak_in_flight) <= min(S, M)
