"""The agreement check where it goes through MPI messages (across nodes, or here: one node
without the shared-memory flags): every kind of mismatch is an error on every rank with the
same headers, the group usable afterwards, and Horovod's join works with rank 0 (the check's
coordinator) or another rank joined. Small ``auto`` all-reduces carry their data on the check
(no MPI_Allreduce), with the results MPI gives."""
import numpy as np
import pytest
import torch

from hpctrain import comm, settings
from hpctrain.comm import algorithms, guard

RANKS = ()  # only without the flags (below): with them the check is a flag exchange
VARIANTS = {"noflags": {"HPCTRAIN_SHM_FLAGS": "0"}}
VARIANT_RANKS = (3,)

comm.init()
N, R = comm.size(), comm.rank()
WORLD = comm.world()


def test_the_check_goes_through_mpi_here():
    assert N > 1 and not WORLD.small_shm
    out = comm.allreduce(np.full(5, R + 1.0))
    np.testing.assert_array_equal(out, np.full(5, N * (N + 1) / 2))


def test_count_shape_and_op_mismatches_raise_on_every_rank():
    length = 12 if R == N - 1 else 10
    with pytest.raises(comm.CollectiveMismatchError) as info:
        comm.allreduce(np.ones(length))
    assert f"ranks {N - 1} called allreduce(sum, float64, 12 elements" in str(info.value)
    assert info.value.headers.shape == (N, guard.HEADER_LEN)  # the same table on every rank
    with pytest.raises(comm.CollectiveMismatchError) as info:  # a larger call on rank 0, and shapes
        comm.allreduce(np.ones((20, 1000) if R == 0 else (3,), dtype=np.float32))
    assert "shape (20, 1000)" in str(info.value) and "shape (3,)" in str(info.value)
    with pytest.raises(comm.CollectiveMismatchError, match="max"):  # only the op differs
        comm.allreduce(np.ones(4), op="max" if R == 1 else "sum")
    out = comm.allreduce(np.full(3, R, dtype=np.int64))
    np.testing.assert_array_equal(out, np.full(3, sum(range(N))))


@pytest.mark.parametrize("other_rank", [0, "last"])
def test_against_another_collective_on_either_side(other_rank):
    odd = 0 if other_rank == 0 else N - 1
    with pytest.raises(comm.CollectiveMismatchError) as info:
        if R == odd:
            comm.broadcast_(np.ones(8, dtype=np.float32))
        else:
            comm.allreduce_(np.ones(8, dtype=np.float32))
    assert "called broadcast(float32, 8 elements" in str(info.value)
    out = comm.allreduce(np.full(3, R + 1, dtype=np.int64))
    np.testing.assert_array_equal(out, np.full(3, N * (N + 1) // 2))


@pytest.mark.parametrize("joined", [0, "last"])
def test_a_joined_rank_stands_in_with_zeros(joined):
    """Horovod's join: the joined rank enters the check with a join header; the others' call
    fails its check, is redone with that rank's zeros, and join returns once all joined."""
    j = 0 if joined == 0 else N - 1
    if R == j:
        assert comm.join() != j
        return
    others = sum(r + 1.0 for r in range(N) if r != j)
    for op, want in (("sum", others), ("avg", others / N)):
        x = np.full(6, R + 1.0, dtype=np.float32)
        out = comm.allreduce_(x, op=op)
        np.testing.assert_allclose(out, np.full(6, want), rtol=1e-6)
    assert WORLD.joined == [j]
    assert comm.join() != j
    assert not WORLD.joined


@pytest.fixture
def mpi_allreduces(monkeypatch):
    """The MPI_Allreduce calls (algorithms.native_) made while the test runs: their sizes."""
    calls = []
    real = algorithms.native_

    def count(comm_, arr, op, dtype_name):
        calls.append(arr.nbytes)
        return real(comm_, arr, op, dtype_name)

    monkeypatch.setattr(algorithms, "native_", count)
    return calls


def rank_data(length, dtype, rank):
    x = np.arange(length) % 5 + rank + 1.0
    if length:
        x[-1] = -(rank + 2.0)  # negatives: min and max differ from first and last rank
    return x.astype(dtype)


CASES = [(dtype, op) for dtype in ("float32", "float64", "float16", "int8", "int32", "int64", "complex64")
         for op in ("sum", "avg", "min", "max", "prod")
         if not (dtype == "complex64" and op in ("min", "max"))]  # refused for complex on every path


@pytest.mark.parametrize("dtype,op", CASES)
def test_small_calls_ride_on_the_check_with_mpis_results(dtype, op, mpi_allreduces):
    length = WORLD.inband // np.dtype(dtype).itemsize
    split = min(WORLD.inband, 96 << 10) // np.dtype(dtype).itemsize  # a part in two messages
    assert length > 0
    for n in (1, 7, split, length):
        x = rank_data(n, dtype, R)
        got = comm.allreduce(x, op=op)
        want = rank_data(n, dtype, R)
        algorithms.native_(WORLD.comm, want, op, np.dtype(dtype).name)  # MPI_Allreduce itself
        if np.dtype(dtype).kind == "f" and op in ("avg", "prod"):
            np.testing.assert_allclose(got, want, rtol=2e-3)
        else:
            np.testing.assert_array_equal(got, want)
        every = comm.allgather_object(got.tobytes())  # merged in one order: the same bits everywhere
        assert every.count(every[0]) == N
    assert mpi_allreduces == [x.nbytes for x in (rank_data(n, dtype, 0) for n in (1, 7, split, length))]  # ours only


def test_nan_in_min_and_max_on_the_check_as_everywhere(mpi_allreduces):
    x = np.arange(6, dtype=np.float32) + R
    x[2] = np.nan if R == N - 1 else x[2]
    for op in ("min", "max"):
        got = comm.allreduce(x, op=op)
        assert np.isnan(got[2]) and not np.isnan(np.delete(got, 2)).any()
    assert mpi_allreduces == []


def test_above_the_limit_a_requested_algorithm_or_bfloat16_mpi_allreduce_runs(mpi_allreduces):
    limit = WORLD.inband
    above = comm.allreduce_route(limit + 4)
    comm.allreduce(np.ones(limit // 4 + 1, dtype=np.float32))
    comm.allreduce(np.ones(8, dtype=np.float32), algorithm="native")
    comm.allreduce(torch.ones(8, dtype=torch.bfloat16))
    if above.kind == "native":
        assert mpi_allreduces == [limit + 4, 32, 16]  # bfloat16 reduced by MPI in float32
    else:  # across nodes above the limit auto chooses at run time: MPI_Allreduce, or another
        assert above.kind == "tuned" and WORLD.topology.num_nodes > 1, above
        assert mpi_allreduces[-2:] == [32, 16] and set(mpi_allreduces[:-2]) <= {limit + 4}
    made = len(mpi_allreduces)
    comm.allreduce(np.ones(8, dtype=np.float32))  # on the check: no MPI_Allreduce
    assert len(mpi_allreduces) == made


def test_above_the_limit_the_check_runs_in_c_and_still_finds_mismatches(monkeypatch):
    """A call too large to ride on the check is checked by the C in-band call with one int64
    (collectives.DecisionCheck), then MPI_Allreduce runs; other ops, sizes or collectives on
    some ranks are still an error on every rank."""
    n = WORLD.inband // 4 + 8
    checked = []
    real = guard.InbandCall.__call__

    def spy(self, x, shape=None):
        checked.append((x.dtype.name, x.size))
        return real(self, x, shape)

    monkeypatch.setattr(guard.InbandCall, "__call__", spy)
    out = comm.allreduce(np.full(n, R + 1.0, dtype=np.float32))
    np.testing.assert_array_equal(out, np.full(n, N * (N + 1) / 2, dtype=np.float32))
    assert checked == [("int64", 1)]
    with pytest.raises(comm.CollectiveMismatchError, match="max"):
        comm.allreduce(np.ones(n, dtype=np.float32), op="max" if R == N - 1 else "sum")
    with pytest.raises(comm.CollectiveMismatchError, match=f"{n + 1} elements"):
        comm.allreduce(np.ones(n + (1 if R == 0 else 0), dtype=np.float32))
    with pytest.raises(comm.CollectiveMismatchError, match="called broadcast"):
        if R == 1:
            comm.broadcast_(np.ones(n, dtype=np.float32))
        else:
            comm.allreduce_(np.ones(n, dtype=np.float32))
    out = comm.allreduce(np.full(n, 2.0, dtype=np.float32))
    np.testing.assert_array_equal(out, np.full(n, 2.0 * N, dtype=np.float32))


def test_a_call_on_the_check_against_a_larger_one_or_a_blocking_tensor():
    limit = WORLD.inband
    with pytest.raises(comm.CollectiveMismatchError) as info:  # rank 0 sends data, the others do not
        comm.allreduce(np.ones(8 if R == 0 else limit // 4 + 1, dtype=np.float32))
    assert "ranks 0 called allreduce(sum, float32, 8 elements" in str(info.value)
    assert f"{limit // 4 + 1} elements" in str(info.value)
    with pytest.raises(comm.CollectiveMismatchError):  # the last rank's data is larger than the rest
        comm.allreduce(np.ones(limit // 8 + (limit // 4 if R == N - 1 else 0), dtype=np.float32))
    t = torch.full((3, 4), R + 1.0)
    comm.allreduce_(t if R % 2 else t.numpy())  # a tensor and a numpy array: the same call
    assert t.eq(N * (N + 1) / 2).all()


@pytest.mark.parametrize("python_on", [0, "last", "leader"])
def test_ranks_in_c_and_in_python_interoperate(python_on, monkeypatch):
    """The C check and the Python one exchange the same messages: a rank without the C path
    (here rank 0, whose decision wins, the last rank, an extra rank folded in where the ranks
    are not a power of two, or the last node's first rank) takes part in the same call."""
    from hpctrain.comm import mpiring

    topology = WORLD.topology
    p = {0: 0, "last": N - 1, "leader": topology.ranks_on(topology.num_nodes - 1)[0]}[python_on]
    monkeypatch.setattr(mpiring, "ENABLED", R != p)
    g = comm.new_group(list(range(N)))  # its own cache of how calls ride on the check
    try:
        # 96 KiB: a part in two messages (guard.CHECK_PIECE_BYTES), cut alike in C and Python
        for dtype, n in (("float32", 9), ("int64", 9), ("int64", min(WORLD.inband, 96 << 10) // 8),
                         ("int64", WORLD.inband // 8)):
            got = comm.allreduce(rank_data(n, dtype, R), op="max", group=g)
            np.testing.assert_array_equal(got, np.max([rank_data(n, dtype, r) for r in range(N)], axis=0))
        mismatch = r"ranks 1 \(world rank 1\) called allreduce\(sum, float32, 5 elements"
        with pytest.raises(comm.CollectiveMismatchError, match=mismatch):
            comm.allreduce(np.ones(5 if R == 1 else 4, dtype=np.float32), group=g)
        got = comm.allreduce(np.full(3, R, dtype=np.float64), op="avg", group=g)
        np.testing.assert_array_equal(got, np.full(3, (N - 1) / 2))
    finally:
        g.free()


def test_with_the_check_off_small_auto_calls_still_take_the_checks_messages(mpi_allreduces):
    """Across nodes the check's messages carry a small all-reduce faster than MPI_Allreduce,
    so with the check off ``auto`` still sends them (every path: a 1-D array, any other shape,
    a tensor), with MPI's sums; calls of different sizes then still meet as a mismatch."""
    comm.set_checks(False)
    try:
        for x in (np.full(5, R + 1.0), np.full((2, 3), R + 1.0, np.float32), torch.full((4,), R + 1.0)):
            got = comm.allreduce(x)
            assert float(got.reshape(-1)[0]) == N * (N + 1) / 2 and tuple(got.shape) == tuple(x.shape)
        y = np.full(7, R + 1.0)
        comm.allreduce_(y)
        assert y.tolist() == [N * (N + 1) / 2] * 7
        with pytest.raises(comm.CollectiveMismatchError):
            comm.allreduce_(np.ones(12 if R == N - 1 else 10))
    finally:
        comm.set_checks(True)
    assert mpi_allreduces == []


def test_the_check_runs_the_schedule_asked_for():
    """HPCTRAIN_CHECK_SCHEDULE: across nodes with several ranks on a node, ``leaders`` hands
    every rank but a node's lowest to a rank of its own node; ``flat`` (or one node, or one
    rank per node) puts every rank of the largest power of two in the recursive doubling."""
    schedule, node_of = WORLD.check_schedule, WORLD.topology.node_of
    flat = settings.rc.check_schedule == "flat" or len(set(node_of)) in (1, N)
    if flat:
        assert (schedule.home >= 0) == (R >= 1 << (N.bit_length() - 1)), schedule
    else:
        lowest = min(r for r in range(N) if node_of[r] == node_of[R])
        if R != lowest:
            assert schedule.home >= 0 and node_of[schedule.home] == node_of[R] and not schedule.partners, schedule
        else:
            assert all(node_of[p] != node_of[R] for p in schedule.partners), schedule
