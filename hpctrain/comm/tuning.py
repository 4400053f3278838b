"""Runtime choice between all-reduce algorithms that all qualify for a call (``auto`` on one
node, private buffers above the flag exchange).

Why at run time: on the 2-core dev machine the fastest algorithm for 1–64 MiB depends on
where the host places the two vCPUs, and that changes every few seconds. In one placement the
piped shared-memory path runs 1.2–1.5× ``MPI_Allreduce`` at 16 MiB; in the other, moving
cache-resident lines between the cores slows ~4× and the same call runs 0.3× while
``MPI_Allreduce`` (through memory) keeps its speed (docs/performance.md). No fixed threshold
is right in both, so ``auto`` measures.

How: the group's local rank 0 keeps, per message-size class, an estimate of each candidate's
time (the median of its last trial's timings, then, while it runs, a moving average) and picks
the best; now and then it gives another
candidate a short trial again, more rarely the worse that one was last time and the more
trials in a row it has lost (the interval doubles with each, up to EXPLORE_MAX), so a change
of state is seen within a few hundred calls at most and exploring costs a few per cent at
first, well under one per cent once the loser has lost a few trials. A trial
clearly slower on its first believed call ends there (CUT_RATIO); the running best gives way
only to a candidate clearly faster (SWITCH_MARGIN), so two within the noise do not trade places; when
its average rises clearly above another's estimate, that one gets a trial at once, and a
single slow call moves the average only so far (STEP_LIMIT). The choice travels to
every rank with the agreement check (``collectives``), so all ranks run the same algorithm.

Pure: no MPI, no clocks; the caller times the calls and reports them with ``record``.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Collection, Dict, Hashable, List, Optional, Sequence, Tuple

from .. import settings

# How often the best candidate is challenged: every EXPLORE_EVERY calls while the others were
# last measured close to it, up to every EXPLORE_MAX calls for a candidate measured 4× slower
# (the interval grows with the square of the last measured ratio, and doubles with each trial
# after the first that the challenger has lost in a row). A challenge is a trial of
# TRIAL_CALLS calls in a row.
EXPLORE_EVERY = 32
EXPLORE_MAX = 512
# Single calls of 1 MiB vary by ±20% here, and every few dozen calls one takes 2-3x (more across
# the namespace nodes, whose TCP runs on the same cores): a trial's estimate is the median of
# its calls after the first WARM_CALLS, so that one such call does not decide it. (The mean
# had put the ring, the fastest at 1 MiB across nodes, at 3.0 ms against its usual 1.0-1.1 ms,
# and `auto` ran MPI_Allreduce, 1.4-1.6x slower, for the rest of a benchmark row.)
TRIAL_CALLS = 5
# Calls after a switch of algorithm that are run but not believed: they pay for the switch.
# Measured with 2 ranks at 2 MiB after ~100 calls of the piped path: MPI_Allreduce's first
# call took 1.4-3.5x its steady time, its second 5-50% more, its third none; the piped path
# after MPI_Allreduce 10-30% more on its first, ~5% on its second. Believing the second call
# cut (CUT_RATIO) every trial of MPI_Allreduce where it was ~10% faster, and auto ran the
# piped path at 0.86-0.90x MPI_Allreduce's speed.
WARM_CALLS = 2
# Calls until every candidate of a three-way choice has had its first trial.
LEARNING_CALLS = 3 * TRIAL_CALLS + 1
# A trial whose call within WARM_CALLS takes more than this x the best's estimate ends at
# once: more than a switch costs (up to 3.5x, above), so the candidate is slower (the
# piped path in the slow state, ~4x MPI_Allreduce at 16 MiB, plus its switch).
ABANDON_RATIO = 4.0
# A trial whose first believed call (after WARM_CALLS) takes more than this × the best's
# estimate ends there: a candidate clearly slower than the best (the piped path at 4 MiB, 2
# ranks) would otherwise cost auto a few percent through its full trials. A candidate cut by
# one noisy call (single calls vary ±20%) is tried again as one CUT_RATIO slower would be, however
# slow that call was; each further loss in a row doubles the interval, as for any loser.
CUT_RATIO = 1.25
# The running best gives way only to a candidate estimated this much faster: two candidates
# within the noise of each other (1 MiB, 2 ranks: the piped path and MPI_Allreduce) otherwise
# trade places every few trials, and each switch costs a cold call (auto then ran slower than
# either candidate alone).
SWITCH_MARGIN = 0.08
WEIGHT = 0.3  # weight of the newest timing in the running candidate's estimate
# The most one timing of the running best counts, as a multiple of its estimate: single calls
# here take 2-3x their usual time every few dozen calls (the host's other work), and a lone
# 2.5x call would lift the estimate by 45% and set off a challenge. Capped at 1.5x, a state 4x
# slower still shows within four calls.
STEP_LIMIT = 1.5


def enabled() -> bool:
    """HPCTRAIN_AUTOTUNE=0 turns run-time tuning off: ``auto`` then uses the fixed thresholds."""
    return settings.rc.autotune


@dataclass
class Arm:
    """What is known of one candidate for one size class."""

    estimate: float = math.inf  # seconds per call
    chosen: int = 0  # calls that ran it (reported through ``record``)
    last_trial: int = -1  # call index where its last trial began
    fresh: bool = True  # the next kept timing replaces the estimate (a new trial)
    kept: int = 0  # timings behind the estimate in the current trial
    samples: List[float] = field(default_factory=list)  # those timings (a trial's median)
    losses: int = 0  # its trials lost in a row against the same best


@dataclass
class SizeClass:
    candidates: Tuple[str, ...]
    arms: Dict[str, Arm] = field(default_factory=dict)
    calls: int = 0
    best: str = ""  # the candidate with the lowest estimate, once all are tried
    countdown: int = 0  # calls of the best before the next trial
    trial: str = ""  # candidate on trial (or whose trial just ended)
    trial_left: int = 0  # calls of that trial still to run
    previous: str = ""  # candidate the call before ran
    warming: int = 0  # calls still to report since the last switch of algorithm, not believed
    challenger: str = ""  # tried next, at once: the running best's average rose above its estimate

    def __post_init__(self) -> None:
        for name in self.candidates:
            self.arms.setdefault(name, Arm())


class Tuner:
    """Picks one of several candidate algorithms per key and learns from reported timings.

    The first WARM_CALLS calls after a switch of algorithm are run but not believed: they pay
    for the switch (MPI's buffers or the flag slots gone cold in the meantime), which would
    otherwise make every challenger look worse than the incumbent.
    """

    def __init__(self, explore_every: int = EXPLORE_EVERY, explore_max: int = EXPLORE_MAX,
                 trial_calls: int = TRIAL_CALLS, weight: float = WEIGHT) -> None:
        if not 1 <= explore_every <= explore_max:
            raise ValueError(f"need 1 ≤ explore_every ≤ explore_max, got {explore_every}, {explore_max}")
        if trial_calls <= WARM_CALLS:
            raise ValueError(f"a trial needs > {WARM_CALLS} calls (its first {WARM_CALLS} are not believed), "
                             f"got {trial_calls}")
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.explore_every = explore_every
        self.explore_max = explore_max
        self.trial_calls = trial_calls
        self.weight = weight
        self.classes: Dict[Hashable, SizeClass] = {}
        self.pending: List[Tuple[Hashable, str, float]] = []  # ``defer``'s timings, in order

    def choose(self, key: Hashable, candidates: Sequence[str]) -> str:
        """The candidate to run for this call of class ``key``.

        Every candidate is first tried (in the order given: put the expected winner first);
        then the best estimate runs, except that every ``interval`` calls the least recently
        tried other candidate runs a trial of ``trial_calls`` calls. Called around every
        tuned collective: the common case (no trial due) is a few attribute updates.
        """
        if self.pending:  # called around every tuned collective: no call when nothing waits
            self.flush()
        sc = self.classes.get(key)
        if sc is None or sc.candidates != candidates:
            sc = self._class(key, candidates)
        sc.calls += 1
        if sc.trial_left:
            sc.trial_left -= 1
            return self._ran(sc, sc.trial)
        if sc.countdown > 0:
            sc.countdown -= 1
            return self._ran(sc, sc.best)
        untried = [n for n in sc.candidates if math.isinf(sc.arms[n].estimate)]
        if untried:
            return self._start_trial(sc, untried[0])
        if sc.challenger:
            name, sc.challenger = sc.challenger, ""
            return self._start_trial(sc, name)
        best = self._leader(sc)
        if best != sc.best:
            self._new_best(sc, best)
        others = [n for n in sc.candidates if n != best]
        if not others:
            sc.countdown = 1 << 62
            return self._ran(sc, best)
        challenger = min(others, key=lambda n: sc.arms[n].last_trial)
        if sc.trial:  # a trial just ended: the best runs for an interval before the next
            loser = sc.arms[sc.trial]
            loser.losses = loser.losses + 1 if sc.trial != best else 0
            sc.trial = ""
            arm = sc.arms[challenger]
            best_estimate = sc.arms[best].estimate
            # a trial cut after one believed call says "slower by CUT_RATIO at least", not by how
            # much: a 3x call of the host's other work would otherwise hold it off 9x as long
            other = min(arm.estimate, CUT_RATIO * best_estimate) if arm.kept == 1 else arm.estimate
            sc.countdown = self.interval(best_estimate, other, arm.losses) - 1
            return self._ran(sc, best)
        return self._start_trial(sc, challenger)

    def choose_run(self, key: Hashable, candidates: Sequence[str], max_calls: int,
                   runnable: Optional[Collection[str]] = None) -> Tuple[str, int]:
        """The candidate for the next calls of class ``key``, and for how many calls (1 to
        ``max_calls``) it stands whatever their timings: the rest of the best's interval
        before the next trial (trials and first tries run call by call, so that a bad one
        can end early). The caller reports every call with ``record``. Lets
        the caller send its choice to the other ranks once per run instead of every call.
        ``runnable``: the candidates the caller runs in runs (None: all); another is chosen
        call by call, and its calls count down the interval one by one."""
        name = self.choose(key, candidates)
        sc = self.classes[key]
        if (sc.trial_left or name == sc.trial or name != sc.best or max_calls <= 1
                or (runnable is not None and name not in runnable)):
            return name, 1
        calls = 1 + min(sc.countdown, max_calls - 1)
        sc.countdown -= calls - 1
        sc.calls += calls - 1
        return name, calls

    def defer(self, key: Hashable, name: str, seconds: float) -> None:
        """``record``, put off until the next choice (or ``flush``, ``counts``): within
        a run nothing is decided, so the timings of its calls change nothing before then, and
        the caller's Python between two calls stays short. After an all-reduce of a few MiB the
        caches hold its data, not the interpreter's: ``record`` after every call cost ~10 µs of
        a 2 MiB call (2 ranks), run once per run for all its calls much less."""
        self.pending.append((key, name, seconds))

    def flush(self) -> None:
        """``record`` every deferred timing, in the order they came."""
        if self.pending:
            pending, self.pending = self.pending, []
            for key, name, seconds in pending:
                self.record(key, name, seconds)

    def record(self, key: Hashable, name: str, seconds: float) -> None:
        """The call of class ``key`` just chosen, which ran ``name``, took ``seconds``."""
        sc = self.classes[key]
        arm = sc.arms[name]
        arm.chosen += 1
        if sc.warming:
            sc.warming -= 1  # counted per call reported (a run reports several)
            if sc.trial_left and sc.best and seconds > ABANDON_RATIO * sc.arms[sc.best].estimate:
                # more than a switch can cost: end the trial here, with this as its estimate
                sc.trial_left = 0
                arm.estimate, arm.fresh, arm.kept, arm.samples = seconds, False, 0, [seconds]
            return
        if arm.fresh:
            arm.estimate, arm.fresh, arm.kept, arm.samples = seconds, False, 1, [seconds]
        elif sc.trial_left or name == sc.trial:  # within a trial: the median of its timings
            arm.kept += 1
            arm.samples.append(seconds)
            arm.estimate = statistics.median(arm.samples)
        else:  # the running best: a moving average that follows changes of state
            # One call counts at most STEP_LIMIT x the average: a lone hiccup moves the
            # average by a few per cent, a real change of state within a few calls.
            arm.estimate += self.weight * (min(seconds, STEP_LIMIT * arm.estimate) - arm.estimate)
        if (sc.trial_left and name == sc.trial and arm.kept == 1 and sc.best and sc.best != name
                and seconds > CUT_RATIO * sc.arms[sc.best].estimate):
            sc.trial_left = 0  # clearly slower on its first believed call: not worth the rest
        if name == sc.best and not sc.trial_left and not sc.challenger:
            # The running best's average rose clearly above another's estimate: try that one
            # at once rather than switch to it. One slow call (a 2.5x hiccup here every few
            # dozen calls) lifts the average past a loser's old estimate; switching on it ran
            # the loser for a whole interval (7-15% of the calls to a path 40% slower). A trial
            # measures it now: it takes over only if it is faster today.
            for other in sc.candidates:
                if sc.arms[other].estimate < (1 - SWITCH_MARGIN) * arm.estimate:
                    sc.challenger, sc.countdown = other, 0
                    break

    def best(self, key: Hashable) -> str:
        """The candidate with the lowest estimate."""
        self.flush()
        sc = self.classes[key]
        return min(sc.candidates, key=lambda n: sc.arms[n].estimate)

    def _leader(self, sc: SizeClass) -> str:
        """The candidate to run between trials: the lowest estimate, unless the one running
        so far is within SWITCH_MARGIN of it."""
        top = min(sc.candidates, key=lambda n: sc.arms[n].estimate)
        held = sc.best
        if held and held != top and (1 - SWITCH_MARGIN) * sc.arms[held].estimate <= sc.arms[top].estimate:
            return held
        return top

    def estimates(self, key: Hashable) -> Dict[str, float]:
        self.flush()
        sc = self.classes[key]
        return {n: sc.arms[n].estimate for n in sc.candidates}

    def interval(self, best_estimate: float, other_estimate: float, losses: int = 0) -> int:
        """Calls between two trials: ``explore_every`` × (other / best)², doubled for each
        trial the other has lost in a row after its first, capped at ``explore_max``."""
        if not best_estimate > 0 or math.isinf(other_estimate):
            return self.explore_every
        ratio = max(1.0, other_estimate / best_estimate)
        backoff = 2.0 ** min(max(0, losses - 1), 16)
        return int(min(self.explore_max, max(self.explore_every, self.explore_every * ratio * ratio) * backoff))

    def counts(self) -> Dict[Hashable, Dict[str, int]]:
        """Calls that ran each candidate, per key (for reports and benchmarks)."""
        self.flush()
        return {key: {n: sc.arms[n].chosen for n in sc.candidates} for key, sc in self.classes.items()}

    def _class(self, key: Hashable, candidates: Sequence[str]) -> SizeClass:
        sc = self.classes.get(key)
        if sc is None or sc.candidates != tuple(candidates):
            sc = self.classes[key] = SizeClass(tuple(candidates))
        return sc

    @staticmethod
    def _new_best(sc: SizeClass, name: str) -> None:
        """Another candidate runs between trials: the machine's state changed, so every
        candidate's losing streak starts again (full-rate trials find the next change soon)."""
        sc.best = name
        for arm in sc.arms.values():
            arm.losses = 0

    def _start_trial(self, sc: SizeClass, name: str) -> str:
        sc.trial, sc.trial_left = name, self.trial_calls - 1
        sc.arms[name].last_trial = sc.calls
        sc.arms[name].fresh = True
        return self._ran(sc, name)

    @staticmethod
    def _ran(sc: SizeClass, name: str) -> str:
        if name != sc.previous:
            sc.warming = WARM_CALLS
        sc.previous = name
        return name


def size_class(nbytes: int) -> int:
    """Messages within a factor of two share their timings: the class is ⌈log2(nbytes)⌉."""
    return max(0, int(nbytes) - 1).bit_length()
