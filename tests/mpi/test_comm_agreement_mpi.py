"""The agreement check where it goes through MPI messages (across nodes, or here: one node
without the shared-memory flags): every kind of mismatch is an error on every rank with the
same headers, the group usable afterwards, and Horovod's join works with rank 0 (the check's
coordinator) or another rank joined."""
import numpy as np
import pytest

from hpctrain import comm
from hpctrain.comm import guard

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
