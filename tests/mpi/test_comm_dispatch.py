"""The lean all-reduce path (numpy arrays, ``auto``) and the general one (torch tensors, any
algorithm) make one decision: for sizes around every threshold, dtypes with and without C
kernels, every op, private and shared buffers, tuning on and off and the agreement check on
and off, both take the same route, give the same result, and a rank on one path pairs with a
rank on the other."""
import numpy as np
import pytest
import torch

from hpctrain import comm, settings
from hpctrain.comm import collectives, plan

RANKS = (2, 3)
TIMEOUT = 360

comm.init()
N, R = comm.size(), comm.rank()
WORLD = comm.world()
with settings.override(autotune=False):
    FIXED = comm.new_group(list(range(N)))  # auto's fixed thresholds, the run-time choice off
GROUPS = {"world": WORLD, "fixed": FIXED}
SMALL = WORLD.small_shm or 256 * 1024  # the flag exchange's limit (when there are flags)
OPS = ["sum", "avg", "min", "max", "prod"]


def lengths(itemsize):
    """0, one element, either side of the flag exchange (where the piped path starts)."""
    last = SMALL // itemsize
    return [0, 1, 5, last, last + 1]


def data(length, dtype, rank, nan=False):
    x = np.arange(length, dtype=np.float64) % 3 + rank + 1  # small integers: every algorithm is exact
    if nan and length:
        x[length // 2] = np.nan if rank == N - 1 else x[length // 2]
    return x.astype(dtype)


def expected(length, dtype, op, nan=False):
    """The reduction of every rank's ``data``, in closed form (rank r holds base + r + 1, small
    whole numbers that every dtype holds exactly): the 32 MiB cases need no array per rank."""
    base = np.arange(length, dtype=np.float64) % 3
    if op == "prod":
        out = np.ones(length)
        for r in range(N):
            out *= base + (r + 1)
    else:
        out = base + {"sum": 0, "avg": 0, "min": 1, "max": N}[op]
        if op == "sum":
            out *= N
            out += N * (N + 1) / 2
        elif op == "avg":
            out += (N + 1) / 2
    if nan and length:
        out[length // 2] = np.nan  # rank N-1's NaN wins every op
    return np.trunc(out) if op == "avg" and np.dtype(dtype).kind in "iu" else out  # integer averages truncate


@pytest.fixture
def spy(monkeypatch):
    """The routes the executor ran (the lean path's flag exchange runs inline: none recorded)."""
    ran = []
    real = collectives._execute

    def record(g, route, *args, **kwargs):
        ran.append(route)
        return real(g, route, *args, **kwargs)

    monkeypatch.setattr(collectives, "_execute", record)
    return ran


def lean_route(g, x, op):
    """What the lean path decides for ``x`` (None: it leaves the call to the general path)."""
    return collectives._lean(g, x.nbytes, x.dtype, op).route


def check(out, length, dtype, op, nan=False):
    want = expected(length, dtype, op, nan)
    got = np.asarray(out, dtype=np.float64)
    if op == "avg" or np.dtype(dtype).kind == "f" and np.dtype(dtype).itemsize == 2:
        np.testing.assert_allclose(got, want, rtol=2e-3)
    else:
        np.testing.assert_array_equal(got, want)


def inline_call(g, x, op):
    """The lean path's call that runs without the executor: for a native route the data on the
    check (check on) or MPI_Allreduce bound once (check off), for a tuned route its bound
    call (collectives._BoundTuned); None for none."""
    entry = collectives._lean(g, x.nbytes, x.dtype, op)
    return x.ndim == 1 and (entry.tuned or (entry.inband if comm.checks_enabled() else entry.native))


def run_both(g, length, dtype, op, spy, nan=False):
    """Lean (numpy) and general (torch) calls of one case on every rank, then mixed paths."""
    x = data(length, dtype, R, nan)
    lean = lean_route(g, x, op)
    spy.clear()
    a = comm.allreduce_(x.copy(), op=op, group=g)
    lean_ran = list(spy)
    spy.clear()
    b = comm.allreduce_(torch.from_numpy(x.copy()), op=op, group=g).numpy()
    assert len(spy) == 1
    general = spy[0]
    assert general == collectives._route(g, x.nbytes, x.dtype.name, "auto", False)
    if lean is None:  # the lean path declined: the general path ran the call
        assert lean_ran == [general]
    elif lean.kind == "flags" or inline_call(g, x, op):  # inline, no executor
        assert lean_ran == [] and general == lean
    else:
        assert lean_ran == [lean] == [general]
    check(a, length, dtype, op, nan)
    np.testing.assert_array_equal(a, b)
    # one rank on each path: same header, same collective, no mismatch and no hang
    mixed = x.copy() if R % 2 == 0 else torch.from_numpy(x.copy())
    c = np.asarray(comm.allreduce_(mixed, op=op, group=g))
    np.testing.assert_array_equal(a, c)
    d = comm.allreduce(x, op=op, group=g)  # out of place: the lean path on a private copy
    np.testing.assert_array_equal(a, d)
    return lean, general


@pytest.mark.parametrize("checks", [True, False])
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "float16"])
def test_lean_and_general_paths_take_one_route(dtype, group, checks, spy):
    g = GROUPS[group]
    comm.set_checks(checks)
    try:
        kinds = set()
        for length in lengths(np.dtype(dtype).itemsize):
            for op in OPS:
                lean, general = run_both(g, length, dtype, op, spy)
                kinds.add(general.kind)
    finally:
        comm.set_checks(True)
    if dtype == "float16":  # no C kernel: MPI, never the lean path
        assert kinds <= {"local", "native"}
    elif g.small_shm:
        assert {"flags", "local"} <= kinds
        assert ("tuned" if g.autotune else "piped") in kinds


@pytest.mark.parametrize("op", ["min", "max"])
def test_nan_propagates_on_both_paths(op, spy):
    for length in (5, SMALL // 4 + 1):
        run_both(WORLD, length, "float32", op, spy, nan=True)


@pytest.mark.parametrize("group", list(GROUPS))
def test_either_side_of_the_large_ring_threshold(group, spy, monkeypatch):
    # The threshold lowered from 32 MiB to 2 MiB (read at each call; the lean path's cached
    # decisions dropped): the same decisions on both sides of it, without the 32 MiB arrays
    # whose first touch cost this test ~15 s at 3 ranks on a 2-core VM.
    g = GROUPS[group]
    monkeypatch.setattr(plan, "LARGE_RING_BYTES", 2 << 20)
    g.routes.clear()
    try:
        for nbytes in (plan.LARGE_RING_BYTES - 4, plan.LARGE_RING_BYTES):
            lean, general = run_both(g, nbytes // 4, "float32", "sum", spy)
            if g.small_shm and not g.autotune:
                assert general.kind == ("piped" if nbytes < plan.LARGE_RING_BYTES else "ring")
    finally:
        g.routes.clear()


def test_non_contiguous_arrays_are_refused_in_place_and_copied_out_of_place(spy):
    for length in (8, SMALL // 4 + 8):
        x = data(2 * length, "float32", R).reshape(length, 2)[:, 0]
        with pytest.raises(ValueError, match="not C-contiguous"):
            comm.allreduce_(x)
        out = comm.allreduce(x)
        ref = comm.allreduce(torch.from_numpy(np.ascontiguousarray(x))).numpy()
        np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("length", [8, 70_000])  # a flag exchange; zero-copy in the window
def test_shared_buffers_route_the_same_on_both_paths(length, spy):
    sbuf = comm.shared_buffer(length, "float32")
    try:
        x = data(length, "float32", R)
        route = comm.allreduce_route(x.nbytes, shared=True)
        for on_lean_path in (True, False, R % 2 == 0):
            np.copyto(sbuf.array, x)
            spy.clear()
            comm.allreduce_(sbuf.array if on_lean_path else sbuf.tensor())
            np.testing.assert_array_equal(sbuf.array, expected(length, "float32", "sum"))
            if route.kind != "flags" or not on_lean_path:
                assert spy == [route]
    finally:
        comm.free_shared_buffer(sbuf)
    if WORLD.small_shm:
        assert route.kind == ("flags" if length * 4 <= SMALL else "zero-copy")


@pytest.mark.parametrize("override", ["shm", "ring", "native"])
def test_an_override_sends_both_paths_to_the_general_one(override, spy):
    saved = collectives._ENV_CHOICE["value"]
    collectives._ENV_CHOICE["value"] = override  # as HPCTRAIN_ALLREDUCE=<override>
    try:
        for length in (5, SMALL // 4 + 1):
            x = data(length, "float32", R)
            want = collectives._route(WORLD, x.nbytes, "float32", override, False)
            spy.clear()
            a = comm.allreduce_(x.copy())
            b = comm.allreduce_(torch.from_numpy(x.copy()) if R % 2 else x.copy())
            assert spy == [want, want]
            np.testing.assert_array_equal(a, np.asarray(b))
            check(a, length, "float32", "sum")
    finally:
        collectives._ENV_CHOICE["value"] = saved


def test_grouped_calls_take_the_route_of_their_total(spy):
    for lengths_ in ([3, 4], [1000, SMALL // 4]):
        xs = [data(n, "float32", R) for n in lengths_]
        total = sum(x.nbytes for x in xs)
        spy.clear()
        comm.grouped_allreduce_(xs)
        assert spy == [comm.allreduce_route(total)]
        for x, n in zip(xs, lengths_):
            check(x, n, "float32", "sum")


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("call", ["allreduce_", "allreduce", "grouped_allreduce_"])
@pytest.mark.parametrize("length", [5, SMALL // 4 + 1])  # a flag exchange; piped or tuned
def test_a_joined_rank_stands_in_with_zeros_on_the_lean_path(length, call, group):
    # The lean path's first call after rank N-1 joined fails its agreement check on the join
    # header and is redone with that rank's zeros; the next call, while it stays joined, skips
    # the lean path. Sum and average (divided by every rank, joined or not) on both.
    g = GROUPS[group]
    if R == N - 1:
        assert comm.join(group=g) in range(N - 1)
        return
    others = sum(r + 1.0 for r in range(N - 1))
    if g.small_shm:  # one node with flags: the lean path takes both sizes
        assert lean_route(g, np.zeros(length, np.float32), "sum") is not None
    for op, want in (("sum", others), ("avg", others / N)):
        x = np.full(length, R + 1.0, dtype=np.float32)
        if call == "allreduce_":
            out = comm.allreduce_(x, op=op, group=g)
        elif call == "allreduce":
            out = comm.allreduce(x, op=op, group=g)
        else:
            comm.grouped_allreduce_([x[:2], x[2:]], op=op, group=g)
            out = x
        np.testing.assert_allclose(out, np.full(length, want), rtol=1e-6)
    assert g.joined == [N - 1]
    assert comm.join(group=g) in range(N - 1)
    assert not g.joined


@pytest.mark.parametrize("length", [5, SMALL // 4 + 1])
def test_a_blocking_call_on_a_tensor_runs_the_lean_path_on_its_memory(length, spy, monkeypatch):
    """``allreduce_now`` (hvd.allreduce, hvd.allreduce_, gradients) on a contiguous CPU tensor:
    the lean path on the tensor's own memory (not the general path's entry), its route, the
    result in the tensor, pairing with a rank on the general path; a named call
    (``agree_on``) takes the general path, which carries the name in its check."""
    from hpctrain.comm.guard import named_shape

    general = []
    real = collectives._allreduce_now
    monkeypatch.setattr(collectives, "_allreduce_now", lambda *a, **k: general.append(a[0]) or real(*a, **k))
    x = data(length, "float32", R)
    lean = lean_route(WORLD, x, "sum")
    t = torch.from_numpy(x.copy())
    spy.clear()
    assert collectives.allreduce_now(t, "sum", inplace=True).wait() is t
    assert general == ([] if lean is not None else [t]) and spy in ([], [lean])
    check(t.numpy(), length, "float32", "sum")
    mixed = torch.from_numpy(x.copy())
    if R % 2 == 0:
        collectives.allreduce_now(mixed, "sum", inplace=True).wait()
    else:
        comm.allreduce_(mixed)  # the general path, on a tensor
    np.testing.assert_array_equal(mixed.numpy(), t.numpy())
    named = torch.from_numpy(x.copy())
    general.clear()
    collectives.allreduce_now(named, "sum", inplace=True, agree_on=named_shape("n", named.shape)).wait()
    assert general == [named]
    np.testing.assert_array_equal(named.numpy(), t.numpy())
