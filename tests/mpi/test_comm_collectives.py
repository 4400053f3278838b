"""hpctrain.comm collectives under a real mpiexec, checked against mpi4py's Allreduce."""
import hashlib
import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain import comm
from hpctrain.comm import plan
from require import skip_or_fail

RANKS = (1, 2, 3, 4)
TIMEOUT = 400
# without shared-memory flags (no C extension, or HPCTRAIN_SHM_FLAGS=0): MPI barriers, the
# coordinator's agreement check and native small all-reduces
# with HPCTRAIN_AUTOTUNE=0: auto's fixed thresholds (the piped path from 256 KiB to 32 MiB)
VARIANTS = {"noflags": {"HPCTRAIN_SHM_FLAGS": "0"}, "fixed": {"HPCTRAIN_AUTOTUNE": "0"}}
VARIANT_RANKS = (3,)

comm.init()
N, R = comm.size(), comm.rank()
# 65536 float32: the largest flag exchange; above it the piped path (65537: two segments)
LENGTHS = sorted({0, 1, max(N - 1, 0), N + 1, 65536, 65537, 1000003})
DTYPES = ["float32", "float64", "float16", "int8", "int32", "int64", "uint8"]
# HPCTRAIN_AUTOTUNE=0 changes only what auto runs: that launch checks auto and leaves the
# explicit algorithms (and the ring's segment edges) to the plain launches.
FIXED = os.environ.get("HPCTRAIN_AUTOTUNE") == "0"
ALGOS = ["auto"] if FIXED else ["native", "ring", "shm", "hierarchical", "auto"]
RING_DTYPES = ["float32"] if FIXED else ["float32", "int32", "float16", "uint8", "float64"]


def local_data(length, dtype, rank):
    rng = np.random.default_rng(1000 * rank + length)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(length).astype(dtype)
    return rng.integers(0, 4, size=length).astype(dtype)  # small ints: no overflow in prod/sum


def reference(x, op):
    if op == "avg":
        ref = np.empty_like(x, dtype=np.float64)
        MPI.COMM_WORLD.Allreduce(x.astype(np.float64), ref, op=MPI.SUM)
        return ref / N
    wide = x.astype(np.float64)
    ref = np.empty_like(wide)
    MPI.COMM_WORLD.Allreduce(wide, ref, op={"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}[op])
    return ref


def assert_same_on_every_rank(result):
    digests = comm.allgather_object(hashlib.sha1(np.ascontiguousarray(result).tobytes()).hexdigest())
    assert len(set(digests)) == 1, "result differs between ranks"


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_sum_every_length(algo, dtype):
    for length in LENGTHS:
        x = local_data(length, dtype, R)
        out = comm.allreduce(x, algorithm=algo)
        assert out.dtype == x.dtype and out.shape == x.shape
        ref = reference(x, "sum")
        tol = {"float16": 5e-3 * N, "float32": 1e-5, "float64": 1e-12}.get(dtype, 0)
        np.testing.assert_allclose(out.astype(np.float64), ref.astype(dtype).astype(np.float64),
                                   rtol=tol, atol=tol * 4, err_msg=f"{algo} {dtype} length {length}")
        assert_same_on_every_rank(out)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("op", ["avg", "min", "max", "prod"])
def test_allreduce_ops(algo, op):
    for dtype in ["float32", "int32"]:
        x = local_data(N + 1, dtype, R) + (1 if op == "prod" else 0)
        out = comm.allreduce(x, op=op, algorithm=algo)
        ref = reference(x, op)
        if op == "avg" and dtype == "int32":
            ref = np.trunc(ref)
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-5, err_msg=f"{algo} {op} {dtype}")


@pytest.mark.parametrize("ring", ["c", "python"])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("dtype", RING_DTYPES)
def test_ring_segments_around_chunk_boundaries(monkeypatch, ring, op, dtype):
    """Tiny ring segments: chunks of one segment, of one element more or less than a segment
    (uneven chunks make some ranks' steps one segment long and others' two: every rank
    must still agree on the pipelined path), and of many segments in the scratch slots.
    Both rings: the C one (hpctrain.comm.mpiring; float16 always takes the Python ring) and
    the Python one."""
    from hpctrain.comm import algorithms, mpiring

    if ring == "c" and not mpiring.available():
        skip_or_fail("mpiring", "the C ring (hpctrain.comm._mpiring) is not built or cannot bind to MPI")
    itemsize = np.dtype(dtype).itemsize
    seg = 5
    monkeypatch.setattr(algorithms, "ring_segment_bytes", lambda: seg * itemsize)  # below the variable's minimum
    monkeypatch.setattr(mpiring, "segment_bytes", lambda: seg * itemsize)
    monkeypatch.setattr(mpiring, "ENABLED", ring == "c")
    lengths = sorted({N * seg - 1, N * seg, N * seg + 1, N * (seg + 1) - 1, N * (seg + 1), N * (seg + 1) + 1,
                      N * seg * 3 + 2, N * seg * (algorithms.RING_SLOTS + 3) + N - 1, 997})
    for length in lengths:
        x = local_data(length, dtype, R)
        out = comm.allreduce(x, op=op, algorithm="ring")
        ref = reference(x, op)
        if op == "avg" and np.dtype(dtype).kind in "iu":
            ref = np.trunc(ref)
        tol = {"float16": 5e-3 * N, "float32": 1e-5, "float64": 1e-12}.get(dtype, 0)
        np.testing.assert_allclose(out.astype(np.float64), ref.astype(dtype).astype(np.float64),
                                   rtol=tol, atol=tol * 4, err_msg=f"ring {op} {dtype} length {length}")
        assert_same_on_every_rank(out)


def test_one_rank_without_the_c_ring_keeps_every_rank_on_the_python_ring():
    """HPCTRAIN_RING_C=0 (or no extension) on one rank: the communicator's first ring agrees
    on the Python ring for all, instead of ranks exchanging different messages."""
    from hpctrain import settings
    from hpctrain.comm import mpiring

    with settings.override(ring_c=settings.rc.ring_c and R != N - 1):
        sub = comm.new_group(list(range(N)))  # a fresh communicator: a fresh agreement
        x = local_data(100_003, "float32", R)
        out = comm.allreduce(x, algorithm="ring", group=sub)
        np.testing.assert_allclose(out, reference(x, "sum"), rtol=1e-5, atol=1e-5)
        assert_same_on_every_rank(out)
        assert mpiring.usable(sub.ring_comm) is (N == 1 and mpiring.available())
    sub.free()


@pytest.mark.parametrize("algo", ALGOS)
def test_bfloat16_and_inplace_tensors(algo):
    t = torch.full((3, 1001), float(R + 1), dtype=torch.bfloat16)
    same = comm.allreduce_(t, algorithm=algo)
    assert same is t
    expected = float(sum(range(1, N + 1)))
    assert torch.all(t.float() == expected)
    avg = comm.allreduce(torch.full((7,), float(R), dtype=torch.bfloat16), op="avg", algorithm=algo)
    assert torch.allclose(avg.float(), torch.full((7,), (N - 1) / 2), rtol=1e-2)


def test_async_in_order():
    handles = [comm.allreduce_async(torch.full((1000,), float(R + i))) for i in range(5)]
    for i, h in enumerate(handles):
        assert torch.all(h.wait() == sum(r + i for r in range(N)))
    assert all(h.done() for h in handles)


def test_allgather_uneven_first_dim():
    x = np.full((R + 1, 3), R, dtype=np.int64)
    out = comm.allgather(x)
    assert out.shape == (sum(r + 1 for r in range(N)), 3)
    np.testing.assert_array_equal(out[:, 0], np.concatenate([[r] * (r + 1) for r in range(N)]))
    t = comm.allgather(torch.tensor([R], dtype=torch.bfloat16))
    assert t.dtype == torch.bfloat16 and t.tolist() == list(range(N))


def test_broadcast_and_objects():
    x = np.full(5, R, dtype=np.float32)
    root = N - 1
    np.testing.assert_array_equal(comm.broadcast(x, root=root), np.full(5, root))
    comm.broadcast_(x, root=0)
    np.testing.assert_array_equal(x, np.zeros(5))
    assert comm.broadcast_object({"from": R}, root=root) == {"from": root}
    assert comm.allgather_object(R * 10) == [r * 10 for r in range(N)]
    comm.barrier()


def test_reduce_scatter_and_alltoall():
    x = np.tile(np.arange(2 * N + 1, dtype=np.float64)[:, None], (1, 2)) * (R + 1)
    part = comm.reduce_scatter(x)
    bounds = [(a, b) for a, b in __import__("hpctrain.comm.plan", fromlist=["x"]).chunk_bounds(2 * N + 1, N)]
    a, b = bounds[R]
    np.testing.assert_allclose(part, x[a:b] / (R + 1) * sum(range(1, N + 1)))
    send = np.arange(N * 2, dtype=np.int32) + 100 * R
    out, splits = comm.alltoall(send)
    assert splits.tolist() == [2] * N
    np.testing.assert_array_equal(out, np.concatenate([[100 * r + 2 * R, 100 * r + 2 * R + 1] for r in range(N)]))


def test_groups_new_group_and_split():
    evens = comm.new_group(list(range(0, N, 2)))
    if R % 2 == 0:
        assert evens.size == len(range(0, N, 2)) and evens.rank == R // 2
        for algo in ALGOS:
            out = comm.allreduce(np.ones(1001), algorithm=algo, group=evens)
            np.testing.assert_array_equal(out, np.full(1001, evens.size))
    else:
        assert evens is None
    half = comm.split(color=R % 2)
    assert half.size == len(range(R % 2, N, 2))
    out = comm.allreduce(np.array([float(R)]), group=half)
    assert out[0] == sum(range(R % 2, N, 2))
    assert comm.allgather_object(R, group=half) == list(range(R % 2, N, 2))


def test_point_to_point_and_size_mismatch():
    if N < 2:
        return
    if R == 0:
        comm.send(torch.arange(10, dtype=torch.float32), dest=1, tag=7)
        comm.send_object({"hello": 1}, dest=1)
        comm.send(np.zeros(3), dest=1, tag=8)
    elif R == 1:
        out = comm.recv(torch.empty(10), source=0, tag=7)
        assert out.tolist() == list(range(10))
        assert comm.recv_object(source=0) == {"hello": 1}
        with pytest.raises(comm.CommError, match="message has 24 bytes"):
            comm.recv(np.zeros(4), source=0, tag=8)
        comm.recv(np.zeros(3), source=0, tag=8)
    comm.barrier()


def test_topology_single_node():
    assert comm.local_size() == N and comm.local_rank() == R
    assert comm.cross_size() == 1 and comm.cross_rank() == 0
    from hpctrain.comm import shmsync

    assert comm.choose_algorithm(64 << 20) == ("native" if N == 1 else "ring")
    assert comm.choose_algorithm(16 << 20) == ("native" if N == 1 else "shm" if shmsync.available() else "native")
    assert comm.choose_algorithm(64 << 20, shared=True) == ("shm" if N > 1 else "native")


def test_mismatched_shapes_raise_on_every_rank():
    if N < 2:
        return
    length = 10 if R != N - 1 else 12
    with pytest.raises(comm.CollectiveMismatchError) as info:
        comm.allreduce(np.ones(length))
    msg = str(info.value)
    assert f"ranks {N - 1} called allreduce(sum, float64, 12 elements" in msg
    with pytest.raises(comm.CollectiveMismatchError, match="float32"):
        comm.allreduce(np.ones(4, dtype=np.float32 if R == 0 else np.float64))
    comm.barrier()  # and the group still works afterwards


def test_small_allreduce_against_another_collective_raises_on_every_rank():
    """One rank in a small (flag-exchange) all-reduce, the others in a broadcast: both paths
    run the agreement check, so every rank gets the same error instead of a hang."""
    if N < 2:
        return
    with pytest.raises(comm.CollectiveMismatchError) as info:
        if R == 0:
            comm.allreduce_(np.ones(8, dtype=np.float32))
        else:
            comm.broadcast_(np.ones(8, dtype=np.float32))
    assert "ranks 0 called allreduce(sum, float32, 8 elements" in str(info.value)
    assert "called broadcast(float32, 8 elements" in str(info.value)
    out = comm.allreduce(np.full(3, R, dtype=np.int64))  # and the group still works afterwards
    np.testing.assert_array_equal(out, np.full(3, sum(range(N))))


@pytest.mark.parametrize("length", [5, 300_000])  # the flag exchange; the piped path (lean path)
def test_numpy_on_some_ranks_torch_on_others_agree(length):
    """numpy arrays take the lean path, torch tensors the general one: same algorithm, same
    agreement header, so mixing them is no mismatch; a different length still is."""
    x = np.full(length, R + 1.0, dtype=np.float32)
    data = x if R % 2 == 0 else torch.from_numpy(x)
    out = comm.allreduce(data)
    np.testing.assert_array_equal(np.asarray(out), np.full(length, sum(range(1, N + 1)), dtype=np.float32))
    if N < 2:
        return
    with pytest.raises(comm.CollectiveMismatchError, match="elements"):
        comm.allreduce_(np.ones(length + (R == N - 1), dtype=np.float32))
    comm.barrier()


def test_small_messages_take_the_flag_exchange_when_built():
    from hpctrain.comm import shmsync

    flags = N > 1 and shmsync.available()
    assert comm.choose_algorithm(4096) == ("shm" if flags else "native")
    assert comm.choose_algorithm(4096, dtype="float16") == "native"  # no C kernel: MPI
    assert comm.choose_algorithm(1 << 20) == ("shm" if flags else "native")  # piped through the slots
    assert comm.choose_algorithm(1 << 20, dtype="float16") == "native"


def test_small_in_place_refusals_keep_the_ranks_in_step():
    # allreduce_ hands a small array straight to the flag exchange; one that is not
    # C-contiguous or is read-only must get the general path's error, with nothing sent
    strided = np.ones((8, 2), dtype=np.float32)[:, 0]
    with pytest.raises(ValueError, match="not C-contiguous"):
        comm.allreduce_(strided)
    frozen = np.ones(8, dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.allreduce_(frozen)
    x = np.full(8, R + 1, dtype=np.float32)
    comm.allreduce_(x)  # the next collective still pairs up on every rank
    np.testing.assert_array_equal(x, np.full(8, N * (N + 1) / 2, dtype=np.float32))
    assert comm.allreduce_(np.full(3, 2.0), op="prod")[0] == 2.0 ** N  # float64, another op


@pytest.mark.parametrize("algo", ["auto", "shm", "hierarchical"])
def test_shared_buffer_zero_copy(algo):
    sbuf = comm.shared_buffer((3, 1001), "float32")
    sbuf.array[:] = R + 1
    same = comm.allreduce_(sbuf.array, algorithm=algo)
    assert same is sbuf.array
    np.testing.assert_array_equal(sbuf.array, np.full((3, 1001), sum(range(1, N + 1))))
    # a "bucket" view in the middle, as a torch tensor, averaged
    t = sbuf.tensor().view(-1)[1000:2500]
    t.fill_(float(R))
    comm.allreduce_(t, op="avg", algorithm=algo)
    assert torch.allclose(t, torch.full((1500,), (N - 1) / 2))
    assert sbuf.array.reshape(-1)[999] == sum(range(1, N + 1))  # outside the view: untouched
    bf = comm.shared_buffer(64, "bfloat16")
    bf.tensor().fill_(1.0)
    comm.allreduce_(bf.tensor(), algorithm=algo)
    assert torch.all(bf.tensor().float() == N)
    comm.free_shared_buffer(bf)
    comm.free_shared_buffer(sbuf)


@pytest.mark.parametrize("sizes", [[300_000, 0, 17, 70_001], [5, 9]])  # piped through the slots; fused copy
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_grouped_allreduce_reduces_every_array_in_place(sizes, op):
    arrays = [local_data(k, "float32", R) for k in sizes]
    refs = [reference(a, op) for a in arrays]
    tensors = [torch.from_numpy(a) if i % 2 else a for i, a in enumerate(arrays)]  # numpy and torch mixed
    out = comm.grouped_allreduce_(tensors, op=op) if op != "max" else comm.grouped_allreduce_async(tensors, op).wait()
    assert all(o is t for o, t in zip(out, tensors))
    for a, ref in zip(arrays, refs):
        np.testing.assert_allclose(a.astype(np.float64), ref, rtol=1e-5, atol=1e-5)
        assert_same_on_every_rank(a)


def test_grouped_allreduce_bfloat16_and_errors():
    ts = [torch.full((70_000,), float(R + 1), dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)]
    comm.grouped_allreduce_(ts)
    assert ts[0].float().eq(sum(range(1, N + 1))).all() and ts[1].float().eq(N).all()
    with pytest.raises(ValueError, match="same dtype"):
        comm.grouped_allreduce_([np.ones(3, np.float32), np.ones(3, np.float64)])
    if N > 1:  # a different total on one rank: a clear error on every rank, no hang
        with pytest.raises(comm.CollectiveMismatchError, match="elements"):
            comm.grouped_allreduce_([np.ones(300_000 + (R == N - 1), np.float32), np.ones(5, np.float32)])
        comm.barrier()


class CyclingTuner:
    """Stands in for local rank 0's tuner: runs every candidate in turn, so that each call
    takes another algorithm and a rank that did not follow the choice would deadlock or differ.
    It asks for runs of 1, 3, 2 and 2 calls in turn, so ranks must also follow runs without a
    decision; a cycle of four, so that among two or three candidates each runs in runs longer
    than one."""

    RUNS = (1, 3, 2, 2)

    def __init__(self):
        self.ran = []
        self.timings = []
        self.decisions = 0

    def choose_run(self, key, candidates, max_calls, runnable=None):
        name = candidates[self.decisions % len(candidates)]
        calls = min(self.RUNS[self.decisions % len(self.RUNS)], max_calls)
        if runnable is not None and name not in runnable:
            calls = 1
        self.decisions += 1
        self.ran.append(name)
        return name, calls

    def record(self, key, name, seconds):
        self.timings.append((name, seconds))

    def defer(self, key, name, seconds):  # the real tuner records these at its next choice
        self.record(key, name, seconds)

    def counts(self):
        return {}


CALLS = 12


# 300_000 float32: shm, native (and the ring from 3 ranks); 600_000 with LARGE_RING_BYTES lowered
# from 32 to 2 MiB (read at each call; the lean path's cached decisions dropped): all three, as
# from 32 MiB, without 36 MB arrays (their first touch alone cost seconds on a 2-core VM)
@pytest.mark.parametrize("length", [300_000, 600_000])
def test_auto_runs_local_rank_0s_choice_on_every_rank(length, monkeypatch):
    monkeypatch.setattr(plan, "LARGE_RING_BYTES", 2 << 20)
    g = comm.world()
    g.routes.clear()
    tuned = g.autotune
    saved, g.tuner = g.tuner, CyclingTuner()
    # Small whole numbers in float32: every algorithm's sum is exact in any order, so each call is
    # checked for equality. One array and its reference; call k reduces base + k (sum:
    # reference + N*k).
    base = np.random.default_rng(R).integers(0, 4, size=length).astype(np.float32)
    base_ref = np.empty_like(base)
    MPI.COMM_WORLD.Allreduce(base, base_ref, op=MPI.SUM)
    try:
        for call in range(CALLS):
            x = base + np.float32(call)
            ref = base_ref + np.float32(N * call)
            if call % 4 == 0:
                out = comm.allreduce_(x.copy())  # the lean path
            elif call % 4 == 1:
                out = comm.allreduce(x)
            elif call % 4 == 2:
                out = comm.allreduce_(torch.from_numpy(x.copy())).numpy()  # the general path
            else:  # several buffers as one collective
                out = x.copy()
                comm.grouped_allreduce_([out[:1000], torch.from_numpy(out[1000:-7]), out[-7:]])
            assert np.array_equal(out, ref), f"call {call}: {np.count_nonzero(out != ref)} elements differ"
        stub = g.tuner
    finally:
        g.tuner = saved
        g.routes.clear()
    if tuned and g.node_flags.rank == 0:
        # the ring joins from RING_CANDIDATE_BYTES at RING_CANDIDATE_RANKS ranks (plan.tuning_candidates)
        ring = N >= plan.RING_CANDIDATE_RANKS and length * 4 >= plan.RING_CANDIDATE_BYTES
        expected = {"ring", "shm", "native"} if ring or length * 4 >= plan.LARGE_RING_BYTES else {"shm", "native"}
        assert set(stub.ran) == expected and len(stub.timings) == CALLS
        assert all(t > 0 for _, t in stub.timings)
        # every call reported, and every pick's runs went on without a decision (checked, with
        # the check on, on the piped path's first flag or in an exchange of their own)
        ran = [name for name, _ in stub.timings]
        assert len(stub.ran) < CALLS and all(ran.count(name) > stub.ran.count(name) for name in expected)
    else:  # only local rank 0 decides; nothing tuned without flags or with HPCTRAIN_AUTOTUNE=0
        assert stub.ran == []


class RunningTuner(CyclingTuner):
    """Always MPI_Allreduce, in runs of 16 calls: every call after a run's first is decided by
    no one and checked in a flag exchange of its own."""

    def choose_run(self, key, candidates, max_calls, runnable=None):
        self.ran.append("native")
        return "native", max_calls


def test_a_mismatch_inside_a_run_of_mpi_allreduce_is_an_error_on_every_rank():
    g = comm.world()
    if not (g.autotune and g.topology.single_node and comm.checks_enabled()):
        pytest.skip("needs auto's run-time choice on one node with the agreement check on")
    saved, g.tuner = g.tuner, RunningTuner()
    g.routes.clear()
    g.tuned_runs.clear()
    try:
        x = np.ones(300_000, np.float32)
        comm.allreduce_(x)  # decides: a run of MPI_Allreduce
        np.testing.assert_array_equal(x, np.full(300_000, N, np.float32))
        comm.allreduce_(x)  # inside the run: agreed without a decision
        mine = np.ones(300_000 + (R == N - 1), np.float32)  # the same size class: inside the run too
        with pytest.raises(comm.CollectiveMismatchError, match="300001"):
            comm.allreduce_(mine)
        if g.node_flags.rank == 0:
            assert g.tuner.ran == ["native"] and len(g.tuner.timings) == 2
    finally:
        g.tuner = saved
        g.routes.clear()
        g.tuned_runs.clear()
    comm.barrier()


def test_tuner_learns_on_local_rank_0_only():
    g = comm.world()
    from hpctrain.comm import tuning

    x = np.ones(300_000, dtype=np.float32)
    before = sum(comm.tuned_counts(x.nbytes).values())
    for _ in range(tuning.LEARNING_CALLS + 5):
        comm.allreduce_(x)
    counts = comm.tuned_counts(x.nbytes)
    deciding = g.autotune and g.node_flags.rank == 0
    if deciding:
        ring = N >= plan.RING_CANDIDATE_RANKS and x.nbytes >= plan.RING_CANDIDATE_BYTES  # a candidate from 3 ranks
        assert set(counts) == {"shm", "native"} | ({"ring"} if ring else set()) and all(counts.values())  # all tried
        assert sum(counts.values()) - before == tuning.LEARNING_CALLS + 5
    else:
        assert counts == {}
    np.testing.assert_array_equal(x, np.full(300_000, N ** (tuning.LEARNING_CALLS + 5), dtype=np.float32))


def test_autotune_is_agreed_when_a_group_is_made():
    """HPCTRAIN_AUTOTUNE off on one rank switches the run-time choice off for the whole node,
    so that no rank waits in a decision exchange the others never enter."""
    from hpctrain import settings

    g = comm.world()
    assert g.autotune == (g.node_flags is not None and settings.rc.autotune)
    with settings.override(autotune=R != N - 1):
        sub = comm.new_group(list(range(N)))
    assert sub.autotune is False
    x = np.full(300_000, R + 1.0, dtype=np.float32)
    comm.allreduce_(x, group=sub)  # the fixed choice, on every rank
    np.testing.assert_array_equal(x, np.full(300_000, sum(range(1, N + 1)), dtype=np.float32))
