"""auto's run-time choice (hpctrain.comm.tuning, plan.tuning_candidates): pure, no MPI.

The tuner is driven by a simulated machine whose algorithms' times change mid-run, as the
dev machine's do when the host moves its vCPUs.
"""
import math

import pytest

from hpctrain import settings
from hpctrain.comm import plan, tuning

ONE_NODE = plan.topology_from_keys(["a", "a"])
TWO_NODES = plan.topology_from_keys(["a", "b"])
THREE_ON_ONE = plan.topology_from_keys(["a", "a", "a"])
SMALL = 256 << 10


def drive(tuner, times, calls, key="k", candidates=("shm", "native"), switch_cost=0.0, bests=None):
    """Run ``calls`` tuned calls; ``times(i)`` gives each candidate's time at call i. The first
    call after a change of algorithm costs ``switch_cost`` more (a sequence: the first calls
    after it, one each). Returns the names run and the total time. ``bests``: a list that gets
    the tuner's running best after each call."""
    costs = tuple(switch_cost) if isinstance(switch_cost, (tuple, list)) else (switch_cost,)
    ran, total, previous, since = [], 0.0, None, 0
    for i in range(calls):
        name = tuner.choose(key, candidates)
        since = 0 if previous not in (None, name) else since + 1
        seconds = times(i)[name] + (costs[since] if previous is not None and since < len(costs) else 0.0)
        tuner.record(key, name, seconds)
        ran.append(name)
        total += seconds
        previous = name
        if bests is not None:
            bests.append(tuner.classes[key].best)
    return ran, total


def trial_starts(ran, name="shm", since=1):
    """Calls (from ``since``) where ``name`` ran after another candidate: its trials."""
    return [i for i in range(max(since, 1), len(ran)) if ran[i] == name and ran[i - 1] != name]


def test_tries_every_candidate_first_then_runs_the_faster():
    tuner = tuning.Tuner()
    ran, _ = drive(tuner, lambda i: {"shm": 2.0, "native": 1.0}, 200)
    assert ran[:tuning.TRIAL_CALLS] == ["shm"] * tuning.TRIAL_CALLS
    assert ran[tuning.TRIAL_CALLS:2 * tuning.TRIAL_CALLS] == ["native"] * tuning.TRIAL_CALLS
    assert tuner.best("k") == "native"
    assert ran[-50:].count("native") >= 47
    assert tuner.estimates("k") == {"shm": 2.0, "native": 1.0}


def test_exploring_costs_a_few_per_cent_and_less_the_worse_the_loser():
    close = tuning.Tuner()
    _, t_close = drive(close, lambda i: {"shm": 1.2, "native": 1.0}, 3000)
    far = tuning.Tuner()
    ran_far, t_far = drive(far, lambda i: {"shm": 4.0, "native": 1.0}, 3000)
    assert t_close / 3000 < 1.0 * 1.03  # ≤ 3% above always running the best
    assert t_far / 3000 < 1.0 * 1.04
    assert ran_far.count("shm") < 3000 * 0.02
    assert far.interval(1.0, 4.0) == tuning.EXPLORE_MAX
    assert close.interval(1.0, 1.0) == close.interval(1.0, 0.5) == tuning.EXPLORE_EVERY
    assert close.interval(1.0, 1.2) < close.interval(1.0, 2.0) < tuning.EXPLORE_MAX


def test_follows_a_change_of_machine_state_both_ways():
    fast = {"shm": 0.8, "native": 1.0}
    slow = {"shm": 3.5, "native": 1.0}

    def times(i):
        return slow if 1000 <= i < 3000 else fast

    tuner = tuning.Tuner()
    ran, _ = drive(tuner, times, 5000)
    assert ran[900:1000].count("shm") > 85  # fast state: the piped path (trials of native aside)
    assert ran[1010:1020].count("native") >= 8  # slowed incumbent abandoned within ~10 calls
    assert ran[1100:3000].count("native") > 1850
    # back to fast: the next trial of shm (at most EXPLORE_MAX calls later) wins it back
    after = ran[3000 + tuning.EXPLORE_MAX + 20:]
    assert after.count("shm") > 0.9 * len(after)


def test_a_challenger_that_keeps_losing_is_tried_ever_more_rarely_until_the_state_changes():
    # the piped path steadily 10% slower (its trials run whole), then 20% faster from call 6000
    tuner = tuning.Tuner()
    ran, _ = drive(tuner, lambda i: {"shm": 1.1 if i < 6000 else 0.8, "native": 1.0}, 9000)
    trials = trial_starts(ran, since=tuning.LEARNING_CALLS)
    before = [t for t in trials if t < 6000]
    gaps = [b - a for a, b in zip(before, before[1:])]
    base = tuner.interval(1.0, 1.1) + tuning.TRIAL_CALLS
    assert gaps[0] < 1.5 * base  # the first loss: the usual interval
    assert all(b > 1.6 * a for a, b in zip(gaps, gaps[1:]) if b < tuning.EXPLORE_MAX)  # then doubling
    assert max(gaps) <= tuning.EXPLORE_MAX + tuning.TRIAL_CALLS + 1  # capped
    assert ran[3000:6000].count("shm") < 0.015 * 3000  # 1% (one trial per EXPLORE_MAX); 11% without the back-off
    # the next trial after the change (within EXPLORE_MAX calls) wins, and native, now the
    # loser, is challenged at the usual rate again: its losing streak starts from nothing
    assert ran[6000 + tuning.EXPLORE_MAX + 20:7500].count("shm") > 0.9 * (1500 - tuning.EXPLORE_MAX - 20)
    native = [t for t in trial_starts(ran, name="native", since=6000)]
    assert len(native) >= 3 and native[1] - native[0] < 1.5 * (tuner.interval(0.8, 1.0) + tuning.TRIAL_CALLS)


def test_the_first_calls_after_a_switch_are_not_believed():
    # a challenger whose first call pays a large switching cost is still judged on its speed
    tuner = tuning.Tuner()
    ran, _ = drive(tuner, lambda i: {"shm": 0.8, "native": 1.0}, 400, switch_cost=5.0)
    assert tuner.best("k") == "shm"
    assert math.isclose(tuner.estimates("k")["shm"], 0.8)
    assert ran[-100:].count("shm") > 90


def test_a_challenger_whose_second_call_still_pays_for_the_switch_wins_when_faster():
    # 2 MiB, 2 ranks, after a run of the piped path (1.1): MPI_Allreduce (1.0) took up to 3.5x
    # on its first call and up to 1.5x on its second. Believing the second call cut its trials
    # (CUT_RATIO) and auto kept the slower piped path.
    tuner = tuning.Tuner()
    ran, total = drive(tuner, lambda i: {"shm": 1.1, "native": 1.0}, 3000, candidates=("shm", "native"),
                       switch_cost=(2.5, 0.5))
    assert tuner.best("k") == "native"
    assert math.isclose(tuner.estimates("k")["native"], 1.0)
    assert ran[200:].count("native") > 0.9 * len(ran[200:])


def test_three_candidates_all_get_trials():
    tuner = tuning.Tuner()
    cands = ("ring", "shm", "native")
    ran, _ = drive(tuner, lambda i: {"ring": 1.0, "shm": 0.9, "native": 1.1}, 2000, candidates=cands)
    assert tuner.best("k") == "shm"
    assert ran.count("ring") > tuning.TRIAL_CALLS and ran.count("native") > tuning.TRIAL_CALLS
    assert ran.count("shm") > 0.8 * 2000


def test_keys_are_independent_and_a_new_candidate_set_restarts_the_class():
    tuner = tuning.Tuner()
    drive(tuner, lambda i: {"shm": 1.0, "native": 2.0}, 50, key="a")
    drive(tuner, lambda i: {"shm": 2.0, "native": 1.0}, 50, key="b")
    assert tuner.best("a") == "shm" and tuner.best("b") == "native"
    drive(tuner, lambda i: {"ring": 1.0, "native": 2.0}, 20, key="a", candidates=("ring", "native"))
    assert set(tuner.counts()["a"]) == {"ring", "native"}


def test_counts_add_up_to_the_calls():
    tuner = tuning.Tuner()
    drive(tuner, lambda i: {"shm": 1.0, "native": 1.1}, 123)
    assert sum(tuner.counts()["k"].values()) == 123


@pytest.mark.parametrize("kwargs", [dict(explore_every=0), dict(explore_every=10, explore_max=5),
                                    dict(trial_calls=1), dict(trial_calls=tuning.WARM_CALLS), dict(weight=0.0),
                                    dict(weight=1.5)])
def test_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        tuning.Tuner(**kwargs)


@pytest.mark.parametrize("nbytes, expected", [(1, 0), (2, 1), (1024, 10), (1025, 11), (1 << 20, 20)])
def test_size_class_is_log2_rounded_up(nbytes, expected):
    assert tuning.size_class(nbytes) == expected


def test_enabled_reads_the_environment(monkeypatch):
    monkeypatch.setenv("HPCTRAIN_AUTOTUNE", "0")
    settings.reset()
    assert not tuning.enabled()
    monkeypatch.setenv("HPCTRAIN_AUTOTUNE", "1")
    settings.reset()
    assert tuning.enabled()
    monkeypatch.delenv("HPCTRAIN_AUTOTUNE")
    settings.reset()


@pytest.mark.parametrize("nbytes, topo, small, pipes, expected", [
    (1 << 20, ONE_NODE, SMALL, True, ("shm", "native")),
    (16 << 20, ONE_NODE, SMALL, True, ("shm", "native")),
    (1 << 20, THREE_ON_ONE, SMALL, True, ("shm", "native", "ring")),  # the ring joins from 3 ranks
    ((1 << 20) - 4, THREE_ON_ONE, SMALL, True, ("shm", "native")),
    (1 << 20, THREE_ON_ONE, SMALL, False, ()),
    (32 << 20, ONE_NODE, SMALL, True, ("ring", "shm", "native")),
    (64 << 20, ONE_NODE, SMALL, False, ("ring", "native")),
    (1 << 20, ONE_NODE, SMALL, False, ()),  # slots too small to pipe: the fixed choice
    (SMALL, ONE_NODE, SMALL, True, ()),  # the flag exchange, no choice to make
    (1 << 20, ONE_NODE, 0, True, ()),  # no flags / a dtype the kernels lack
    (1 << 20, TWO_NODES, SMALL, True, ("ring", "native", "hierarchical")),  # several nodes: the fixed choice first
    (plan.CROSS_NODE_TUNING_BYTES - 1, TWO_NODES, 0, False, ()),  # several nodes, small: MPI_Allreduce
    (1 << 20, plan.topology_from_keys(["a"]), SMALL, True, ()),
])
def test_tuning_candidates(nbytes, topo, small, pipes, expected):
    assert plan.tuning_candidates(nbytes, topo, small, pipes) == expected


def test_a_challenger_far_slower_on_its_first_call_is_dropped_at_once():
    # the slow state of the dev machine: the piped path ~4× MPI_Allreduce at 16 MiB
    tuner = tuning.Tuner()
    ran, _ = drive(tuner, lambda i: {"shm": 4.0, "native": 1.0}, 2000, switch_cost=0.5)
    trials = trial_starts(ran)
    assert len(trials) >= 3
    # after learning, each trial of the slow candidate is one call, not TRIAL_CALLS
    assert all(ran[i + 1] == "native" for i in trials[1:])
    # slower by no more than a switch can cost: judged on its believed calls
    tuner = tuning.Tuner()
    ran, _ = drive(tuner, lambda i: {"shm": 3.0, "native": 1.0}, 200)
    assert all(ran[i + tuning.WARM_CALLS] == "shm" for i in trial_starts(ran))
    assert ran.count("shm") <= tuning.TRIAL_CALLS + len(trials)


def test_a_challenger_clearly_slower_on_its_first_believed_call_is_cut_there():
    # 4 MiB, 2 ranks: the piped path ~1.45× MPI_Allreduce's time
    tuner = tuning.Tuner()
    ran, total = drive(tuner, lambda i: {"shm": 1.45, "native": 1.0}, 3000)
    trials = trial_starts(ran)
    assert len(trials) >= 6  # fewer and fewer: each lost trial doubles the interval
    # after learning, a trial is the switch's calls and one believed call, not TRIAL_CALLS
    assert all(ran[i + tuning.WARM_CALLS + 1] == "native" for i in trials[1:])
    assert total / 3000 < 1.02
    # a challenger only slightly slower still gets its whole trial
    tuner = tuning.Tuner()
    ran, _ = drive(tuner, lambda i: {"shm": 1.15, "native": 1.0}, 1000)
    later = trial_starts(ran, since=100)
    assert later and all(ran[i:i + tuning.TRIAL_CALLS] == ["shm"] * tuning.TRIAL_CALLS for i in later[:-1])


def test_candidates_within_the_noise_do_not_trade_places_every_few_trials():
    # 1 MiB, 2 ranks: the piped path and MPI_Allreduce 3% apart, single calls ±20%, a
    # switch costs a cold call
    import random

    rng = random.Random(0)
    bests = []
    drive(tuning.Tuner(), lambda i: {"shm": rng.uniform(0.8, 1.2), "native": 1.03 * rng.uniform(0.8, 1.2)},
          3000, switch_cost=0.15, bests=bests)
    flips = sum(1 for i in range(200, 3000) if bests[i] != bests[i - 1])
    assert flips < 60  # ~150 when any lower estimate took over at once
    # a candidate clearly faster still takes over
    tuner = tuning.Tuner()
    ran, _ = drive(tuner, lambda i: {"shm": 1.0, "native": 1.0 if i < 500 else 0.8}, 1500)
    assert ran[-500:].count("native") > 0.85 * 500


def test_noisy_timings_still_favour_the_faster():
    # single 1 MiB calls vary by ±20% on the dev machine; candidates 10% apart
    import random

    rng = random.Random(7)
    tuner = tuning.Tuner()
    ran, total = drive(tuner, lambda i: {"shm": 1.1 * rng.uniform(0.8, 1.2), "native": rng.uniform(0.8, 1.2)}, 3000)
    assert ran[200:].count("native") > 0.8 * len(ran[200:])
    assert total / 3000 < 1.05


def test_choose_run_commits_to_the_best_between_trials_only():
    t = tuning.Tuner(explore_every=32, explore_max=512, trial_calls=3)
    key, cands = "k", ("shm", "native")
    runs = []
    for _ in range(200):
        name, calls = t.choose_run(key, cands, 16)
        runs.append((name, calls))
        for _ in range(calls):
            t.record(key, name, 1.0 if name == "shm" else 2.0)
    sc = t.classes[key]
    # first tries and trials call by call; the best in runs of up to 16
    assert all(calls == 1 for name, calls in runs if name == "native")
    assert max(calls for _, calls in runs) == 16
    assert sum(calls for _, calls in runs) == sc.calls  # every call counted once
    assert t.counts()[key]["shm"] + t.counts()[key]["native"] == sc.calls
    assert t.best(key) == "shm" and t.estimates(key)["native"] == pytest.approx(2.0)


def test_a_best_the_caller_runs_call_by_call_still_runs_its_whole_interval():
    """The caller runs only some candidates in runs (one node, check on: the piped path); a
    best it runs call by call must count down the interval one call at a time. Charging it a
    run's calls it never ran let the slower candidate's trials come every few calls (one node,
    4 MiB: the piped path ran 60% of the calls at 0.84x MPI_Allreduce's speed)."""
    t = tuning.Tuner(explore_every=32, explore_max=512, trial_calls=5)
    key, cands = "k", ("shm", "native")
    ran = []
    for _ in range(2000):
        name, calls = t.choose_run(key, cands, 16, runnable=("shm",))
        if name == "native":
            assert calls == 1
        for _ in range(calls):
            t.record(key, name, 1.0 if name == "native" else 1.15)
            ran.append(name)
    tail = ran[200:]
    assert tail.count("native") > 0.85 * len(tail)  # shm on trial about 5 calls in every 37 or more
    assert t.best(key) == "native"


def test_choose_run_of_one_call_is_choose():
    a, b = tuning.Tuner(), tuning.Tuner()
    seq_a, seq_b = [], []
    for i in range(300):
        na = a.choose("k", ("x", "y"))
        nb, calls = b.choose_run("k", ("x", "y"), 1)
        assert calls == 1
        seq_a.append(na)
        seq_b.append(nb)
        t = 1.0 + (i % 7) * 0.01 + (0.5 if na == "y" else 0)
        a.record("k", na, t)
        b.record("k", nb, 1.0 + (i % 7) * 0.01 + (0.5 if nb == "y" else 0))
    assert seq_a == seq_b


def test_a_run_reports_its_first_calls_as_the_switch_only():
    """After a trial, the best's run: its first WARM_CALLS calls pay for the switch (not
    believed), the others are averaged in — a run must not leave every call marked as a switch."""
    t = tuning.Tuner(explore_every=4, explore_max=4, trial_calls=tuning.WARM_CALLS + 1)
    key, cands = "k", ("a", "b")
    previous, since, runs = None, 0, 0
    for _ in range(40):
        name, calls = t.choose_run(key, cands, 8)
        runs += calls > 1
        for _ in range(calls):
            since = 0 if name != previous else since + 1
            t.record(key, name, 5.0 if since < tuning.WARM_CALLS else (1.0 if name == "a" else 3.0))
            previous = name
    assert runs > 5 and t.estimates(key)["a"] == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(4))
def test_a_lone_slow_call_of_the_best_does_not_hand_the_calls_to_a_slower_candidate(seed):
    # 4 MiB, 2 ranks: MPI_Allreduce 1.0, the piped path 1.43, each ±10%, and one call in 50
    # of either 2.5x slower (the host's other work). Switching on the moving average gave the
    # piped path 6-15% of the calls (auto ran 6-10% slower than MPI_Allreduce alone).
    import random

    rng = random.Random(seed)

    def times(i):
        native = rng.uniform(0.9, 1.1) * (2.5 if rng.random() < 0.02 else 1.0)
        shm = 1.43 * rng.uniform(0.9, 1.1) * (2.5 if rng.random() < 0.02 else 1.0)
        return {"native": native, "shm": shm}

    ran, total = drive(tuning.Tuner(), times, 3000, candidates=("native", "shm"), switch_cost=0.1)
    assert ran[100:].count("shm") < 0.02 * len(ran[100:])
    assert total / 3000 < 1.055  # the spikes alone cost 1.03


def test_a_best_whose_average_rises_above_a_loser_gives_the_loser_a_trial_first():
    tuner = tuning.Tuner()
    ran, _ = drive(tuner, lambda i: {"native": 1.0 if i < 500 else 1.6, "shm": 1.4}, 700,
                   candidates=("native", "shm"))
    # from call 500 the best is slower than the loser's old estimate: a trial of the loser
    # (not a switch on the old estimate), which it wins
    first = next(i for i in range(500, 700) if ran[i] == "shm")
    assert first < 510
    assert ran[first:first + tuning.TRIAL_CALLS] == ["shm"] * tuning.TRIAL_CALLS
    assert ran[-100:].count("shm") > 90
    assert tuner.best("k") == "shm"


@pytest.mark.parametrize("seed", range(3))
def test_deferred_timings_decide_exactly_as_timings_recorded_at_once(seed):
    """``defer`` (what one node's call does) records at the next choice: within a run nothing
    is decided, so a tuner fed the same timings late picks the same runs, keeps the same
    estimates and counts, through state changes, trials, switches and slow spikes."""
    import random

    rng = random.Random(seed)
    now, later = tuning.Tuner(), tuning.Tuner()
    key, cands = "k", ("shm", "native", "ring")
    picks_now, picks_later = [], []
    for i in range(3000):
        a, b = now.choose_run(key, cands, 16), later.choose_run(key, cands, 16)
        picks_now.append(a)
        picks_later.append(b)
        assert a == b, f"decision {i}: {a} against {b}"
        for _ in range(a[1]):
            base = {"shm": 1.0, "native": 0.9, "ring": 1.3} if (i // 400) % 2 else {"shm": 0.8, "native": 1.0,
                                                                                     "ring": 1.2}
            seconds = base[a[0]] * rng.uniform(0.8, 1.2) * (2.5 if rng.random() < 0.03 else 1.0)
            now.record(key, a[0], seconds)
            later.defer(key, a[0], seconds)
    assert later.pending  # the last run's timings wait for the next choice ...
    assert later.counts() == now.counts() and not later.pending  # ... or for counts
    assert later.estimates(key) == now.estimates(key)
    assert len({name for name, _ in picks_now}) == 3


def test_one_slow_call_in_a_trial_does_not_keep_the_faster_candidate_out():
    # across nodes at 1 MiB: the ring 0.7, MPI_Allreduce 1.0; one believed call of the ring's
    # first trial takes 10x (the host's other work): the trial's median still says 0.7
    tuner = tuning.Tuner()
    slow_call = tuning.WARM_CALLS + 1  # the ring's second believed call
    ran, _ = drive(tuner, lambda i: {"ring": 7.0 if i == slow_call else 0.7, "native": 1.0}, 300,
                   candidates=("ring", "native"))
    assert math.isclose(tuner.estimates("k")["ring"], 0.7, rel_tol=0.05)
    assert ran[tuning.LEARNING_CALLS:].count("ring") > 0.9 * (300 - tuning.LEARNING_CALLS)


def test_a_trial_cut_by_one_slow_call_is_tried_again_soon():
    # the piped path leads (0.8 against 1.0), slows for a while (native takes over), then is
    # 0.8 again; its first trial after that is cut by one 3x call on its first believed call:
    # one call is no verdict, so the next trial comes as for a challenger CUT_RATIO slower
    # (32 x 1.25^2, doubled per loss in a row), not 32 x 3^2 calls later
    tuner = tuning.Tuner()
    key, candidates = "k", ("shm", "native")
    ran, cut_at = [], None
    for i in range(1500):
        name = tuner.choose(key, candidates)
        sc = tuner.classes[key]
        first_believed = name == "shm" and sc.trial == "shm" and sc.arms["shm"].fresh and sc.warming == 0
        if cut_at is not None and i == cut_at + 1:
            losses = sc.arms["shm"].losses  # counted as the trial ended, when its interval was set
        seconds = {"shm": 2.0 if 200 <= i < 230 else 0.8, "native": 1.0}[name]
        if cut_at is None and i >= 230 and first_believed and sc.best == "native":
            seconds, cut_at = 3.0, i
        tuner.record(key, name, seconds)
        ran.append(name)
    assert cut_at is not None and ran[cut_at + 1] == "native", "the slow call did not cut the trial"
    again = next(i for i in range(cut_at + 1, len(ran)) if ran[i] == "shm")
    limit = tuner.interval(1.0, tuning.CUT_RATIO, losses) + 2
    assert again - cut_at <= limit < tuner.interval(1.0, 3.0, losses), f"tried again {again - cut_at} calls after the cut"
    assert ran[again + 50:].count("shm") > 0.9 * len(ran[again + 50:])
