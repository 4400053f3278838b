"""Under a real mpiexec: the agreement check compares shapes (not just element counts) on
every path that checks, and min/max propagate NaN the same way whichever algorithm runs."""
import os

import numpy as np
import pytest
import torch

from hpctrain import comm
from require import skip_or_fail

RANKS = (2, 3)
TIMEOUT = 300
# without shared-memory flags: the coordinator's check over MPI messages; with auto's fixed
# thresholds: the piped path without the run-time choice
VARIANTS = {"noflags": {"HPCTRAIN_SHM_FLAGS": "0"}, "fixed": {"HPCTRAIN_AUTOTUNE": "0"}}
VARIANT_RANKS = (3,)  # the fall-back paths at 3 ranks (not a power of two); the plain suite runs 2 and 3

comm.init()
N, R = comm.size(), comm.rank()


def shape_of(small: bool):
    """Rank 0 passes (a, b), the others (b, a): the same element count, another shape."""
    a, b = (10, 100) if small else (300, 1000)  # 4 KB: one flag exchange; 1.2 MB: piped / tuned
    return (a, b) if R == 0 else (b, a)


def f32(shape):
    return np.ones(shape, dtype=np.float32)


CALLS = {  # every public path that checks agreement, with the shape it passes
    "allreduce_ lean small": lambda s: comm.allreduce_(f32(s)),
    "allreduce lean small": lambda s: comm.allreduce(f32(s)),
    "allreduce_ torch (general)": lambda s: comm.allreduce_(torch.ones(s)),
    "native": lambda s: comm.allreduce(f32(s), algorithm="native"),
    "ring": lambda s: comm.allreduce(f32(s), algorithm="ring"),
    "shm": lambda s: comm.allreduce(f32(s), algorithm="shm"),
    "hierarchical": lambda s: comm.allreduce(f32(s), algorithm="hierarchical"),
    "grouped": lambda s: comm.grouped_allreduce_([f32(s), f32(5)]),
    "grouped torch": lambda s: comm.grouped_allreduce_([torch.ones(s), f32(5)]),
    "broadcast_": lambda s: comm.broadcast_(f32(s)),
    "broadcast": lambda s: comm.broadcast(torch.ones(s)),
    "reduce_scatter": lambda s: comm.reduce_scatter(f32(s)),
    "shared_buffer": lambda s: comm.shared_buffer(s, "float32"),
}


@pytest.mark.parametrize("small", [True, False])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_shape_mismatch_raises_on_every_rank_and_names_both_shapes(name, small):
    mine, other = shape_of(small), shape_of(small)[::-1]
    with pytest.raises(comm.CollectiveMismatchError) as info:
        CALLS[name](mine)
    msg = str(info.value)
    assert f"{mine}" in msg and f"{other}" in msg, msg
    assert "HINT" in msg
    out = comm.allreduce(np.full(3, R, dtype=np.int64))  # the next collective still pairs up
    np.testing.assert_array_equal(out, np.full(3, sum(range(N))))


@pytest.mark.parametrize("small", [True, False])
def test_the_same_shape_on_every_rank_passes_whatever_the_type(small):
    """numpy arrays take the lean path, torch tensors the general one: both fold the same
    shape code into the header, so mixing them is no mismatch."""
    shape = (10, 100) if small else (300, 1000)
    x = np.full(shape, R + 1.0, dtype=np.float32)
    out = comm.allreduce(x if R % 2 == 0 else torch.from_numpy(x))
    np.testing.assert_array_equal(np.asarray(out), np.full(shape, sum(range(1, N + 1)), dtype=np.float32))
    ts = [torch.from_numpy(x.copy()), np.ones(5, np.float32)] if R % 2 else [x.copy(), np.ones(5, np.float32)]
    comm.grouped_allreduce_(ts)
    np.testing.assert_array_equal(np.asarray(ts[0]), np.full(shape, sum(range(1, N + 1)), dtype=np.float32))


def test_a_1d_against_a_2d_array_of_the_same_count_is_a_mismatch():
    with pytest.raises(comm.CollectiveMismatchError, match=r"1000 elements of shape \(1000,\)"):
        comm.allreduce_(f32((1000,) if R == 0 else (10, 100)))
    comm.barrier()


# --------------------------------------------------------------------------- NaN in min / max
def nan_data(rank, length, dtype):
    """Rank r holds NaN where i % (N + 1) == r (so every position has NaN on at most one rank,
    and every (N+1)-th on none), ordinary values elsewhere."""
    rng = np.random.default_rng(100 * rank + length)
    x = rng.standard_normal(length).astype(dtype)
    x[rank::N + 1] = np.nan
    return x


def expected_nan(length, dtype, op):
    kernel = {"min": np.minimum, "max": np.maximum}[op]
    out = nan_data(0, length, dtype)
    for q in range(1, N):
        out = kernel(out, nan_data(q, length, dtype))
    return out


# HPCTRAIN_AUTOTUNE=0 changes only what auto runs: that launch checks auto alone.
ALGOS = ["auto"] if os.environ.get("HPCTRAIN_AUTOTUNE") == "0" else [
    "native", "ring-c", "ring-python", "shm", "hierarchical", "auto"]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_min_max_propagate_nan_on_every_algorithm(monkeypatch, algo, op, dtype):
    from hpctrain.comm import mpiring

    if algo == "ring-c" and not mpiring.available():
        skip_or_fail("mpiring", "the C ring (hpctrain.comm._mpiring) is not built or cannot bind to MPI")
    monkeypatch.setattr(mpiring, "ENABLED", algo != "ring-python")
    # a flag exchange; piped / windowed; and for auto the size its run-time choice tunes (an
    # explicit algorithm takes the same path at 300_000 as at 70_001)
    for length in (7, 70_001, 300_000) if algo == "auto" else (7, 70_001):
        x = nan_data(R, length, dtype)
        out = comm.allreduce(x, op=op, algorithm=algo.split("-")[0])
        np.testing.assert_array_equal(out, expected_nan(length, dtype, op), err_msg=f"{algo} {length}")
        nan_in_place = torch.from_numpy(x.copy())  # the general path, in place
        comm.allreduce_(nan_in_place, op=op, algorithm=algo.split("-")[0])
        np.testing.assert_array_equal(nan_in_place.numpy(), expected_nan(length, dtype, op))


@pytest.mark.parametrize("op", ["min", "max"])
def test_bfloat16_and_reduce_scatter_propagate_nan_too(op):
    x = nan_data(R, 1000, "float32")
    out = comm.allreduce(torch.from_numpy(x).to(torch.bfloat16), op=op)
    expected = torch.from_numpy(expected_nan(1000, "float32", op)).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    from hpctrain.comm import plan

    rows = comm.reduce_scatter(x.reshape(100, 10), op=op)
    lo, hi = plan.chunk_bounds(100, N)[R]
    np.testing.assert_array_equal(rows, expected_nan(1000, "float32", op).reshape(100, 10)[lo:hi])
