"""The agreement check over MPI (guard._exchange) on simulated ranks: threads swapping parts
through queues in place of MPI, at every group size from 2 to 9 (powers of two and groups
with extra ranks folded in). Every rank must learn the same verdict, rank 0's decision and
the same bits of an in-band all-reduce; a rank in another call is a mismatch on every rank."""
from __future__ import annotations

import contextlib
import queue
import threading

import numpy as np
import pytest

from hpctrain.comm import guard
from hpctrain.comm.errors import CollectiveMismatchError
from hpctrain.comm.plan import check_schedule


class Request:
    def __init__(self, wait=lambda: None):
        self.Wait = wait


class FakeComm:
    """Point-to-point messages between threads (one queue per ordered pair of ranks: MPI keeps
    one sender's messages in order; a send completes at once, a receive when waited on) and an
    allgather; what guard's check calls. Records every message's size."""

    def __init__(self, rank, hub):
        self.rank, self.hub = rank, hub

    def Isend(self, spec, dest, tag):
        message = bytes(spec[0].reshape(-1))
        self.hub.sizes.append(len(message))
        self.hub.queues[(self.rank, dest)].put(message)
        return Request()

    def Irecv(self, spec, source, tag):
        def wait():
            message = self.hub.queues[(source, self.rank)].get(timeout=20)
            buf = spec[0].reshape(-1)
            assert len(message) <= buf.nbytes, "a message larger than the receive buffer (MPI: truncation)"
            buf[:len(message)] = np.frombuffer(message, np.uint8)

        return Request(wait)

    def allgather(self, obj):
        self.hub.gathered[self.rank] = obj
        self.hub.barrier.wait(timeout=20)
        out = list(self.hub.gathered)
        self.hub.barrier.wait(timeout=20)
        return out

    def Get_size(self):
        return self.hub.size


class Hub:
    def __init__(self, size):
        self.size = size
        self.queues = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
        self.sizes = []  # every message's bytes
        self.gathered = [None] * size
        self.barrier = threading.Barrier(size)


class FakeGroup:
    name = "world"

    def __init__(self, rank, size, hub, inband=1024, node_of=None):
        self.rank, self.size, self.inband, self.seq = rank, size, inband, 0
        self.check_schedule = check_schedule(rank, size, node_of)
        self.ctl_comm = FakeComm(rank, hub)
        self.check_io = None

    @staticmethod
    def describe_ranks(ranks):
        return "ranks " + ",".join(map(str, ranks))


class Dog:
    @staticmethod
    def watch(*args, **kwargs):
        return contextlib.nullcontext()


def nodes(size, layout):
    """Each rank's node: "flat" none (every rank a candidate for the core), "blocks" three
    ranks per node in rank order (as mpiexec and srun place them; the last node may hold
    fewer), "round-robin" ranks dealt to two nodes in turn."""
    return {"flat": None, "blocks": tuple(r // 3 for r in range(size)),
            "round-robin": tuple(r % 2 for r in range(size))}[layout]


LAYOUTS = ["flat", "blocks", "round-robin"]


def run_ranks(size, body, layout="flat"):
    """``body(group)`` on every simulated rank; returns each rank's result or exception."""
    hub = Hub(size)
    out = [None] * size

    def run(rank):
        try:
            out[rank] = body(FakeGroup(rank, size, hub, node_of=nodes(size, layout)))
        except Exception as exc:  # the test looks at it
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a simulated rank hangs"
    return out


def exchange(g, *args):
    """guard._exchange with the group's CheckIO (as agree and InbandCall give it)."""
    return guard._exchange(g, guard._io(g), *args)


def header(op="allreduce", count=5):
    return guard.make_header(1, op, "sum", "float64", count)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", range(2, 10))
def test_every_rank_gets_the_same_bits_and_rank_0s_decision(size, layout):
    rng = np.random.default_rng(size)
    data = [rng.standard_normal(5) * 10.0 ** rng.integers(-3, 6, 5) for _ in range(size)]

    def body(g):
        x = data[g.rank].copy()
        decision = exchange(g, header(), Dog(), None, lambda: "allreduce", 40 + g.rank, x, "sum", "float64")
        return decision, x

    out = run_ranks(size, body, layout)
    assert all(decision == 40 for decision, _ in out)  # rank 0's
    first = out[0][1]
    assert all(x.tobytes() == first.tobytes() for _, x in out)  # the same bits everywhere
    np.testing.assert_allclose(first, np.sum(data, axis=0), rtol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", range(2, 10))
@pytest.mark.parametrize("odd", [0, "last", "middle"])
def test_a_rank_in_another_call_is_a_mismatch_on_every_rank(size, odd, layout):
    bad = {0: 0, "last": size - 1, "middle": size // 2}[odd]

    def body(g):
        if g.rank == bad:  # a plain check of a broadcast: no data
            return exchange(g, header("broadcast", -1), Dog(), None, lambda: "broadcast")
        x = np.ones(5)
        return exchange(g, header(), Dog(), None, lambda: "allreduce", 0, x, "sum", "float64")

    out = run_ranks(size, body, layout)
    assert all(isinstance(e, CollectiveMismatchError) for e in out), out
    assert all(len(e.headers) == size for e in out)
    assert all(f"ranks {bad} called broadcast" in str(e) for e in out), str(out[0])


def test_float16_sums_in_float32_rounded_once_and_integer_averages_truncate():
    halves = [2048.0, 1.0, 1.0]  # in float16 2048 + 1 is 2048 again

    def half(g):
        x = np.array([halves[g.rank]], np.float16)
        exchange(g, header(), Dog(), None, lambda: "allreduce", 0, x, "sum", "float16")
        return x

    assert all(x[0] == 2050.0 for x in run_ranks(3, half))

    def average(g):
        x = np.array([[7, 0, 1][g.rank], [-7, 0, -1][g.rank]], np.int32)
        exchange(g, header(), Dog(), None, lambda: "allreduce", 0, x, "avg", "int32")
        return x

    assert all(x.tolist() == [2, -2] for x in run_ranks(3, average))  # 8 / 3 and -8 / 3, once (rank 2 too)

    def average_of_two(g):
        x = np.array([7, -7], np.int32) if g.rank == 0 else np.zeros(2, np.int32)
        exchange(g, header(), Dog(), None, lambda: "allreduce", 0, x, "avg", "int32")
        return x

    assert all(x.tolist() == [3, -3] for x in run_ranks(2, average_of_two))  # toward zero


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_parts_larger_than_a_piece_travel_in_two_messages_and_calls_of_other_sizes_still_mismatch(size, layout,
                                                                                                   monkeypatch):
    """Pieces of 512 bytes: an in-band sum of 100 float64 (80 + 800 bytes a part, at most two
    pieces) travels as 512 + 368 bytes, with the same bits everywhere; a rank whose call holds
    20 elements (one message) is a mismatch on every rank, and no message is left unreceived."""
    monkeypatch.setattr(guard, "CHECK_PIECE_BYTES", 512)
    rng = np.random.default_rng(size)
    data = [rng.standard_normal(100) for _ in range(size)]

    def body(g):
        x = data[g.rank].copy()
        exchange(g, header(count=100), Dog(), None, lambda: "allreduce", 0, x, "sum", "float64")
        return x

    hub_sizes = []

    def recording(body):
        def run(g):
            hub_sizes.append(g.ctl_comm.hub.sizes)
            return body(g)
        return run

    out = run_ranks(size, recording(body), layout)
    assert all(x.tobytes() == out[0].tobytes() for x in out)
    np.testing.assert_allclose(out[0], np.sum(data, axis=0), rtol=1e-12)
    assert hub_sizes[0] and set(hub_sizes[0]) == {512, 80 + 800 - 512}

    hubs = []

    def odd_one(g):
        hubs.append(g.ctl_comm.hub)
        count = 20 if g.rank == size - 1 else 100
        x = np.ones(count)
        return exchange(g, header(count=count), Dog(), None, lambda: "allreduce", 0, x, "sum", "float64")

    out = run_ranks(size, odd_one, layout)
    assert all(isinstance(e, CollectiveMismatchError) for e in out), out
    assert all(q.empty() for q in hubs[0].queues.values())


@pytest.mark.parametrize("size,layout", [(6, "blocks"), (9, "blocks"), (7, "round-robin")])
def test_across_nodes_only_the_node_leaders_parts_cross_between_nodes(size, layout):
    """Every message of a check whose sender and receiver sit on different nodes is between
    two node leaders (each node's lowest rank), and each leader sends at most one per step."""
    node_of = nodes(size, layout)
    leaders = {min(r for r in range(size) if node_of[r] == n) for n in set(node_of)}
    sent = []

    class Recording(FakeComm):
        def Isend(self, spec, dest, tag):
            sent.append((self.rank, dest))
            return super().Isend(spec, dest, tag)

    def body(g):
        g.ctl_comm = Recording(g.rank, g.ctl_comm.hub)
        x = np.full(3, float(g.rank))
        exchange(g, header(count=3), Dog(), None, lambda: "allreduce", 0, x, "sum", "float64")
        return x

    out = run_ranks(size, body, layout)
    assert all(x.tolist() == [sum(range(size))] * 3 for x in out)
    crossing = [(a, b) for a, b in sent if node_of[a] != node_of[b]]
    assert crossing and all(a in leaders and b in leaders for a, b in crossing), crossing
    steps = check_schedule(0, size, node_of).steps
    assert all(sum(1 for a, _ in crossing if a == leader) <= steps + 1 for leader in leaders)


def test_a_stalled_check_is_reported_first_by_the_rank_waiting_where_it_stopped():
    """Grace and "not arrived" of a wait in the check: on 2 nodes x 8, rank 0 waiting for rank
    4 (which gathers ranks 5-7 first) waits 2 s per level of rank 4's tree, longer than rank
    4's own waits, and says rank 4 may itself wait; a leaf is named plainly; the step across
    nodes comes after every wait in a tree. Without trees (flat) the stage alone orders them."""
    blocks = tuple(r // 8 for r in range(16))
    hub = Hub(16)
    leader = FakeGroup(0, 16, hub, node_of=blocks)
    middle = FakeGroup(4, 16, hub, node_of=blocks)

    def wait(group, rank, stage):
        where = np.array([rank, stage], np.int32)
        return guard._stage_grace(group.check_schedule, where)(), guard._waited_for(group, where)()

    assert wait(leader, 1, 0) == (0.0, "ranks 1")
    grace, text = wait(leader, 4, 0)
    assert grace == 4.0 and "ranks 4 (which gathers its own ranks' parts" in text and "may itself wait" in text
    assert max(wait(middle, 5, 0)[0], wait(middle, 6, 0)[0]) < grace
    grace, text = wait(leader, 8, 1)
    assert grace == 2.0 * (leader.check_schedule.levels + 1) > 4.0 and "step 1 of 1" in text
    assert "gathers this rank's part" in wait(middle, 0, 2)[1]
    flat = FakeGroup(0, 4, Hub(4))
    assert wait(flat, 1, 1) == (2.0, "ranks 1") and wait(flat, 2, 2)[0] == 4.0


def test_a_homed_ranks_wait_for_the_result_outlasts_every_core_step():
    """A rank with a home waits for the result after the core's last step, and the C check
    writes stage 1 for that wait (it counts steps from the homed rank's empty partner list):
    its grace must still exceed every core rank's, so that the rank waiting where the check
    really stopped reports first. Flat 3 ranks: rank 2 (home 0) against rank 0 at its step
    with rank 1; 2 nodes x 3: a leaf against its leader at the step across nodes."""
    def grace(group, partner, stage):
        return guard._stage_grace(group.check_schedule, np.array([partner, stage], np.int32))()

    hub = Hub(3)
    core, homed = FakeGroup(0, 3, hub), FakeGroup(2, 3, hub)
    assert homed.check_schedule.home == 0 and core.check_schedule.partners == (1,)
    assert all(grace(homed, 0, stage) > grace(core, 1, 1) for stage in (1, 2))
    blocks = (0, 0, 0, 1, 1, 1)
    hub = Hub(6)
    leader, leaf = FakeGroup(0, 6, hub, node_of=blocks), FakeGroup(1, 6, hub, node_of=blocks)
    assert leaf.check_schedule.home == 0
    across = grace(leader, 3, 1)
    assert all(grace(leaf, 0, stage) > across for stage in (1, 2))
