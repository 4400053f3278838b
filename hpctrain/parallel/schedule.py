"""Pipeline schedules as pure plans: which stage runs which forward/backward, and in which order
its messages go out and come in.

Two levels:

1. :func:`make_schedule` — per stage, the compute actions ``("fwd", m)`` / ``("bwd", m)``:

   - **GPipe**: all M forwards, then all M backwards (micro-batch order 0…M−1 both times).
     A stage holds the activations of all M micro-batches at the turn.
   - **1F1B** (PipeDream-flush / Megatron): stage s runs ``min(S−s−1, M)`` warm-up forwards,
     then alternates one forward and one backward, then drains the remaining backwards. A stage
     holds at most ``S−s`` micro-batches' activations (≤ S), whatever M.

2. :func:`lower` — turns the compute actions into each stage's program of blocking
   point-to-point operations (recv activation, fwd, send activation, recv gradient, bwd, send
   gradient). The order of the messages is found by simulating all stages together in rounds
   where a send and its matching receive happen at the same moment (a rendezvous). Because
   such a complete execution exists, the programs cannot deadlock under any timing, even when
   every MPI send blocks until its receive is posted: every wait has a partner that no other
   wait precedes (see :func:`simulate`, which re-checks exactly that). A send may be deferred
   past the next compute action, which is what breaks the classic 1F1B deadlock (stage s
   sending an activation forward while stage s+1 sends a gradient back).

The same simulation with unit-time compute gives the schedule's bubble; with equal forward and
backward times it equals ``(S−1)/(M+S−1)`` for both schedules.
"""
from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

SCHEDULES = ("gpipe", "1f1b")

Action = Tuple[str, int]  # ("fwd" | "bwd", micro-batch index)

# Point-to-point program operations.
RECV_ACT, FWD, SEND_ACT, RECV_GRAD, BWD, SEND_GRAD = "recv_act", "fwd", "send_act", "recv_grad", "bwd", "send_grad"
COMPUTE_OPS = (FWD, BWD)


class ScheduleError(ValueError):
    """A schedule that is malformed or whose cross-stage dependencies cannot be satisfied."""


class DeadlockError(ScheduleError):
    """A set of programs in which some stages wait for each other forever."""


def normalize_schedule(name: str) -> str:
    """Canonical schedule name ('gpipe' or '1f1b'); accepts a few common spellings."""
    key = str(name).strip().lower().replace("-", "").replace("_", "")
    aliases = {"gpipe": "gpipe", "fillthendrain": "gpipe", "1f1b": "1f1b", "oneforwardonebackward": "1f1b",
               "pipedream": "1f1b", "pipedreamflush": "1f1b"}
    if key not in aliases:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    return aliases[key]


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The theoretical idle fraction of a synchronous pipeline: (S−1)/(M+S−1)."""
    _check_sizes(stages, micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def _check_sizes(stages: int, micro_batches: int) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline stages must be an integer ≥ 1, got {stages!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an integer ≥ 1, got {micro_batches!r}")


def gpipe_actions(stage: int, stages: int, micro_batches: int) -> Tuple[Action, ...]:
    """GPipe: every forward, then every backward."""
    _check_stage(stage, stages)
    return tuple([("fwd", m) for m in range(micro_batches)] + [("bwd", m) for m in range(micro_batches)])


def one_f_one_b_actions(stage: int, stages: int, micro_batches: int) -> Tuple[Action, ...]:
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    _check_stage(stage, stages)
    warmup = min(stages - stage - 1, micro_batches)
    actions: List[Action] = [("fwd", m) for m in range(warmup)]
    for i in range(micro_batches - warmup):
        actions.append(("fwd", warmup + i))
        actions.append(("bwd", i))
    actions.extend(("bwd", m) for m in range(micro_batches - warmup, micro_batches))
    return tuple(actions)


def _check_stage(stage: int, stages: int) -> None:
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in [0, {stages})")


@dataclass(frozen=True)
class Schedule:
    """Per-stage compute actions of one training step."""

    kind: str
    stages: int
    micro_batches: int
    actions: Tuple[Tuple[Action, ...], ...]  # actions[s] for stage s

    def __post_init__(self) -> None:
        if len(self.actions) != self.stages:
            raise ScheduleError(f"{len(self.actions)} action lists for {self.stages} stages")
        for s, acts in enumerate(self.actions):
            check_stage_order(acts, self.micro_batches, s)

    @property
    def bubble_fraction(self) -> float:
        """Theoretical bubble (S−1)/(M+S−1)."""
        return bubble_fraction(self.stages, self.micro_batches)

    def peak_in_flight(self, stage: int) -> int:
        """Most micro-batches whose forward ran and whose backward did not yet, on ``stage``."""
        return max(in_flight_profile(self.actions[stage]), default=0)


def make_schedule(kind: str, stages: int, micro_batches: int) -> Schedule:
    """The compute actions of every stage for schedule ``kind`` ('gpipe' or '1f1b')."""
    kind = normalize_schedule(kind)
    _check_sizes(stages, micro_batches)
    build = gpipe_actions if kind == "gpipe" else one_f_one_b_actions
    return Schedule(kind, stages, micro_batches, tuple(build(s, stages, micro_batches) for s in range(stages)))


def check_stage_order(actions: Sequence[Action], micro_batches: int, stage: int = 0) -> None:
    """Each micro-batch has exactly one forward and one backward, the forward first."""
    seen_fwd, seen_bwd = set(), set()
    for kind, m in actions:
        if kind not in ("fwd", "bwd") or not 0 <= m < micro_batches:
            raise ScheduleError(f"stage {stage}: bad action {(kind, m)!r}")
        if kind == "fwd":
            if m in seen_fwd:
                raise ScheduleError(f"stage {stage}: forward of micro-batch {m} twice")
            seen_fwd.add(m)
        else:
            if m not in seen_fwd:
                raise ScheduleError(f"stage {stage}: backward of micro-batch {m} before its forward")
            if m in seen_bwd:
                raise ScheduleError(f"stage {stage}: backward of micro-batch {m} twice")
            seen_bwd.add(m)
    missing = set(range(micro_batches)) - seen_bwd
    if missing or len(seen_fwd) != micro_batches:
        raise ScheduleError(f"stage {stage}: micro-batches {sorted(missing)} lack a forward or backward")


def in_flight_profile(actions: Sequence[Action]) -> List[int]:
    """After each action, how many micro-batches hold activations (forward done, backward not)."""
    held, out = 0, []
    for kind, _ in actions:
        held += 1 if kind == "fwd" else -1
        out.append(held)
    return out


# --------------------------------------------------------------------------- lowering
@dataclass(frozen=True)
class Op:
    """One step of a stage's program. ``peer`` is the neighbouring stage of a send/recv."""

    kind: str  # recv_act | fwd | send_act | recv_grad | bwd | send_grad
    micro_batch: int
    peer: Optional[int] = None


@dataclass(frozen=True)
class Program:
    """Every stage's operations for one step, in execution order."""

    schedule: Schedule
    ops: Tuple[Tuple[Op, ...], ...]

    def for_stage(self, stage: int) -> Tuple[Op, ...]:
        return self.ops[stage]


def _needed_recv(stage: int, stages: int, action: Action) -> Optional[Op]:
    kind, m = action
    if kind == "fwd" and stage > 0:
        return Op(RECV_ACT, m, stage - 1)
    if kind == "bwd" and stage < stages - 1:
        return Op(RECV_GRAD, m, stage + 1)
    return None


def _produced_send(stage: int, stages: int, action: Action) -> Optional[Op]:
    kind, m = action
    if kind == "fwd" and stage < stages - 1:
        return Op(SEND_ACT, m, stage + 1)
    if kind == "bwd" and stage > 0:
        return Op(SEND_GRAD, m, stage - 1)
    return None


def _matches(send: Op, sender: int, recv: Op) -> bool:
    want = RECV_ACT if send.kind == SEND_ACT else RECV_GRAD
    return recv.kind == want and recv.micro_batch == send.micro_batch and recv.peer == sender


def lower(schedule: Schedule) -> Program:
    """Each stage's ordered point-to-point program (deadlock-free under blocking sends).

    Rounds: first every send whose receiver is waiting for exactly that message is paired with
    it (repeated until none is left), then every stage whose next action has its input computes
    it. Sends whose receiver is not ready stay pending (their tensor is held) and go out in a
    later round. Raises :class:`ScheduleError` if the schedule's dependencies cannot be met.
    """
    S = schedule.stages
    acts = schedule.actions
    pos = [0] * S
    # pending sends per stage and neighbour, oldest first (per-channel FIFO order)
    pending: List[Dict[int, Deque[Op]]] = [{} for _ in range(S)]
    have: List[set] = [set() for _ in range(S)]  # received (kind, m)
    ops: List[List[Op]] = [[] for _ in range(S)]

    def next_recv(s: int) -> Optional[Op]:
        if pos[s] >= len(acts[s]):
            return None
        need = _needed_recv(s, S, acts[s][pos[s]])
        if need is None or (need.kind, need.micro_batch) in have[s]:
            return None
        return need

    while True:
        progressed = False
        # comm phase: rendezvous pairs, repeated until none matches
        matched = True
        while matched:
            matched = False
            for s in range(S):
                for queue in pending[s].values():
                    if not queue:
                        continue
                    op = queue[0]
                    want = next_recv(op.peer)
                    if want is not None and _matches(op, s, want):
                        queue.popleft()
                        ops[s].append(op)
                        ops[op.peer].append(want)
                        have[op.peer].add((want.kind, want.micro_batch))
                        matched = progressed = True
        # compute phase: one action per ready stage
        for s in range(S):
            if pos[s] < len(acts[s]) and next_recv(s) is None:
                kind, m = acts[s][pos[s]]
                ops[s].append(Op(FWD if kind == "fwd" else BWD, m))
                send = _produced_send(s, S, acts[s][pos[s]])
                if send is not None:
                    pending[s].setdefault(send.peer, deque()).append(send)
                pos[s] += 1
                progressed = True
        if all(p == len(a) for p, a in zip(pos, acts)) and not any(q for d in pending for q in d.values()):
            break
        if not progressed:
            stuck = {s: (acts[s][pos[s]] if pos[s] < len(acts[s]) else None) for s in range(S)}
            raise ScheduleError(f"{schedule.kind} schedule with S={S}, M={schedule.micro_batches}: cross-stage "
                                f"dependencies cannot be satisfied; next action per stage: {stuck}")
    return Program(schedule, tuple(tuple(o) for o in ops))


def make_program(kind: str, stages: int, micro_batches: int) -> Program:
    """Schedule and lower in one call (cached: a program depends only on its arguments)."""
    return _cached_program(normalize_schedule(kind), stages, micro_batches)


@functools.lru_cache(maxsize=64)
def _cached_program(kind: str, stages: int, micro_batches: int) -> Program:
    return lower(make_schedule(kind, stages, micro_batches))


# --------------------------------------------------------------------------- simulation
@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate` with unit-time compute and instantaneous messages."""

    rounds: int  # time until the last compute finished
    busy: Tuple[int, ...]  # compute rounds per stage
    peak_in_flight: Tuple[int, ...]  # most micro-batches holding activations, per stage
    peak_pending_sends: Tuple[int, ...]  # most computed-but-unsent tensors, per stage

    @property
    def bubble_fraction(self) -> float:
        """Mean idle fraction of the stages over the step."""
        if self.rounds == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.rounds)


def simulate(program: Program, fwd_time: int = 1, bwd_time: int = 1) -> SimResult:
    """Run ``program`` with strictly blocking sends (a send completes only together with its
    receive) and check it: every message is received by the op it was meant for, every stage
    finishes. Compute takes ``fwd_time``/``bwd_time`` ticks; messages take none.

    Raises :class:`DeadlockError` naming the blocked operations if the stages get stuck.
    """
    ops = program.ops
    S = len(ops)
    pc = [0] * S
    clock = [0] * S  # time at which each stage is free for its next op
    busy = [0] * S
    held = [0] * S
    peak_held = [0] * S
    unsent = [0] * S
    peak_unsent = [0] * S
    while any(pc[s] < len(ops[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while pc[s] < len(ops[s]):
                op = ops[s][pc[s]]
                if op.kind in COMPUTE_OPS:
                    cost = fwd_time if op.kind == FWD else bwd_time
                    clock[s] += cost
                    busy[s] += cost
                    held[s] += 1 if op.kind == FWD else -1
                    peak_held[s] = max(peak_held[s], held[s])
                    if _produced_send(s, S, (op.kind, op.micro_batch)) is not None:
                        unsent[s] += 1
                        peak_unsent[s] = max(peak_unsent[s], unsent[s])
                    pc[s] += 1
                    progressed = True
                    continue
                peer = op.peer
                if peer is None or not 0 <= peer < S:
                    raise DeadlockError(f"stage {s}: {op} has no valid peer")
                if pc[peer] >= len(ops[peer]):
                    raise DeadlockError(f"stage {s} waits in {op} for stage {peer}, which has finished")
                other = ops[peer][pc[peer]]
                if op.kind in (SEND_ACT, SEND_GRAD):
                    send, recv, sender, receiver = op, other, s, peer
                else:
                    send, recv, sender, receiver = other, op, peer, s
                if other.peer != s or other.kind in COMPUTE_OPS or (op.kind in (SEND_ACT, SEND_GRAD)) == (
                        other.kind in (SEND_ACT, SEND_GRAD)):
                    break  # the peer is busy with something else; maybe later
                if not _matches(send, sender, recv):
                    raise DeadlockError(f"stage {sender} sends {send} but stage {receiver} expects {recv}: "
                                        "messages would be matched to the wrong micro-batch")
                t = max(clock[s], clock[peer])
                clock[s] = clock[peer] = t
                pc[s] += 1
                pc[peer] += 1
                unsent[sender] -= 1
                progressed = True
                break
        if not progressed:
            blocked = {s: ops[s][pc[s]] for s in range(S) if pc[s] < len(ops[s])}
            raise DeadlockError(f"deadlock: blocked operations per stage: {blocked}")
    return SimResult(max(clock) if clock else 0, tuple(busy), tuple(peak_held), tuple(peak_unsent))
