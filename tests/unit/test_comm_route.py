"""plan.route: the one all-reduce decision (kind, header algorithm, run-time candidates), every
branch, without MPI."""
import pytest
from hypothesis import given, strategies as st

from hpctrain.comm import plan
from hpctrain.comm.plan import LARGE_RING_BYTES as LARGE, Route

ONE = plan.topology_from_keys(["a"])
NODE2 = plan.topology_from_keys(["a", "a"])
NODE3 = plan.topology_from_keys(["a", "a", "a"])
TWO_NODES = plan.topology_from_keys(["a", "a", "b", "b"])
UNEVEN = plan.topology_from_keys(["a", "a", "b"])
SMALL = 256 * 1024  # the flag exchange's limit for a dtype its kernels take


def r(nbytes, topo=NODE2, requested="auto", shared=False, small_shm=SMALL, pipes=None, autotune=False,
      cross_node=plan.CROSS_NODE, inband=0):
    if pipes is None:  # as the flag slots answer: a piped call is larger than a flag exchange
        pipes = bool(small_shm) and nbytes > small_shm
    return plan.route(nbytes, topo, requested, shared=shared, small_shm=small_shm, pipes=pipes, autotune=autotune,
                      cross_node=cross_node, inband=inband)


@pytest.mark.parametrize("autotune", [False, True])
def test_across_nodes_up_to_the_in_band_limit_auto_rides_on_the_check_instead_of_tuning(autotune):
    limit = 256 * 1024
    native = Route("native", "native", auto=True)
    assert r(limit, TWO_NODES, small_shm=0, autotune=autotune, inband=limit) == native  # not tuned, not the ring
    assert r(plan.CROSS_NODE_TUNING_BYTES, TWO_NODES, small_shm=0, autotune=autotune, inband=limit) == native
    above = r(limit + 8, TWO_NODES, small_shm=0, autotune=autotune, inband=limit)
    assert above.kind == ("tuned" if autotune else "ring")  # from the limit on as before
    assert r(limit, TWO_NODES, "ring", small_shm=0, autotune=autotune, inband=limit) == Route("ring", "ring")
    # a shared buffer (zero-copy gradient buckets across nodes) too: the data is copied onto the check
    assert r(limit, TWO_NODES, small_shm=0, shared=True, inband=limit) == native
    assert r(limit, TWO_NODES, small_shm=0, shared=True).kind == "ring"  # without in-band room: as before
    # one node without flags (the check over MPI): a shared buffer stays zero-copy
    assert r(plan.SHARED_SMALL_BYTES, NODE2, small_shm=0, shared=True, inband=limit) == Route("zero-copy", "shm")
    assert r(0, TWO_NODES, small_shm=0, inband=limit).kind == "local"
    # without in-band room (the check off for the dtype: bfloat16, bool; or the setting 0) as before
    assert r(limit, TWO_NODES, small_shm=0, autotune=True).kind == "tuned"


@pytest.mark.parametrize("autotune", [False, True])
@pytest.mark.parametrize("nbytes,expected", [
    (0, Route("local", "native")),                  # nothing to reduce: only the agreement check
    (4, Route("flags", "shm")),                     # one element
    (1024, Route("flags", "shm")),
    (SMALL, Route("flags", "shm")),                 # the flag exchange's last size
])
def test_small_private_buffers_take_one_flag_exchange(nbytes, expected, autotune):
    assert r(nbytes, autotune=autotune) == expected


def test_above_the_flag_exchange_a_private_buffer_is_piped_or_tuned():
    assert r(SMALL + 1) == Route("piped", "shm")
    assert r(LARGE - 1) == Route("piped", "shm")
    assert r(LARGE) == Route("ring", "ring")         # Open MPI's large-message algorithm degrades
    assert r(SMALL + 1, autotune=True) == Route("tuned", "auto", ("shm", "native"))
    assert r(LARGE - 1, autotune=True) == Route("tuned", "auto", ("shm", "native"))
    assert r(LARGE, autotune=True) == Route("tuned", "auto", ("ring", "shm", "native"))
    assert r(LARGE, pipes=False, autotune=True) == Route("tuned", "auto", ("ring", "native"))
    assert r(1 << 20, NODE3, autotune=True) == Route("tuned", "auto", ("shm", "native", "ring"))


def test_without_piping_the_fixed_thresholds_stand():
    # slots too small to pipe (HPCTRAIN_SHM_SLOT_BYTES), tuning or not: the whole-buffer window
    for autotune in (False, True):
        assert r(SMALL + 1, pipes=False, autotune=autotune) == Route("shm", "shm")
    assert r(LARGE, pipes=False) == Route("ring", "ring")


def test_dtypes_without_kernels_go_to_mpi():
    # small_shm 0 and no pipes: float16, bfloat16, complex, bool, or no C extension
    for nbytes in (4, SMALL, SMALL + 1, LARGE - 1):
        for autotune in (False, True):
            assert r(nbytes, small_shm=0, autotune=autotune) == Route("native", "native")
    assert r(LARGE, small_shm=0, autotune=True) == Route("ring", "ring")
    assert r(0, small_shm=0) == Route("local", "native")


def test_shared_buffers_go_zero_copy_and_never_tuned():
    assert r(4, shared=True) == Route("flags", "shm")  # a flag exchange wherever the data lies
    assert r(4, shared=True, small_shm=0) == Route("native", "native")
    assert r(plan.SHARED_SMALL_BYTES - 1, shared=True, small_shm=0) == Route("native", "native")
    assert r(plan.SHARED_SMALL_BYTES, shared=True, small_shm=0) == Route("zero-copy", "shm")
    for autotune in (False, True):
        assert r(SMALL + 1, shared=True, autotune=autotune) == Route("zero-copy", "shm")
        assert r(LARGE, shared=True, autotune=autotune) == Route("zero-copy", "shm")
    assert r(plan.CROSS_NODE[1], TWO_NODES, shared=True, small_shm=0) == Route("zero-copy", "hierarchical")
    assert r(1 << 20, TWO_NODES, "ring", shared=True, small_shm=0) == Route("ring", "ring")
    assert r(1 << 20, ONE, "shm", shared=True, small_shm=0) == Route("local", "shm")


def test_requested_algorithms_are_kept_and_never_tuned():
    for autotune in (False, True):
        assert r(SMALL + 1, requested="native", autotune=autotune) == Route("native", "native")
        assert r(4, requested="ring", autotune=autotune) == Route("ring", "ring")
        assert r(4, requested="shm", autotune=autotune) == Route("flags", "shm")
        assert r(SMALL + 1, requested="shm", autotune=autotune) == Route("piped", "shm")
        assert r(LARGE, requested="shm", autotune=autotune) == Route("piped", "shm")
        assert r(SMALL + 1, requested="hierarchical", autotune=autotune) == Route("piped", "shm")  # one node
    assert r(4, requested="shm", small_shm=0) == Route("shm", "shm")  # the window: no flag kernels
    assert r(0, requested="ring") == Route("local", "ring")


def test_several_nodes():
    ring_from, hierarchical_from = plan.CROSS_NODE
    cases = [(4, "auto", Route("native", "native")),
             (ring_from - 4, "auto", Route("native", "native")),
             (ring_from, "auto", Route("ring", "ring")),
             (hierarchical_from - 4, "auto", Route("ring", "ring")),
             (hierarchical_from, "auto", Route("hierarchical", "hierarchical")),
             (ring_from, "shm", Route("hierarchical", "hierarchical")),
             (4, "hierarchical", Route("hierarchical", "hierarchical"))]
    for nbytes, requested, expected in cases:  # the fixed choice (HPCTRAIN_AUTOTUNE=0); small_shm is 0
        assert r(nbytes, TWO_NODES, requested, small_shm=0, pipes=False) == expected
        tuned = r(nbytes, TWO_NODES, requested, small_shm=0, pipes=False, autotune=True)
        if requested != "auto" or nbytes < plan.CROSS_NODE_TUNING_BYTES:
            assert tuned == expected
        else:  # auto's run-time choice, the fixed choice first
            assert tuned.kind == "tuned" and tuned.candidates[0] == expected.algorithm
            assert sorted(tuned.candidates) == ["hierarchical", "native", "ring"]
    assert r(64 << 20, UNEVEN, small_shm=0) == Route("ring", "ring")  # hierarchical needs even nodes
    # the group's own thresholds (HPCTRAIN_CROSS_NODE_*_BYTES)
    assert r(1 << 10, TWO_NODES, small_shm=0, cross_node=(0, 1 << 20)) == Route("ring", "ring")
    assert r(1 << 20, TWO_NODES, small_shm=0, cross_node=(0, 1 << 20)) == Route("hierarchical", "hierarchical")
    assert r(64 << 20, TWO_NODES, small_shm=0, cross_node=(128 << 20, 128 << 20)) == Route("native", "native")
    # data in a shared buffer: zero-copy where the hierarchical path runs, else as a private buffer
    assert r(hierarchical_from, TWO_NODES, small_shm=0, shared=True) == Route("zero-copy", "hierarchical")
    assert r(ring_from, TWO_NODES, small_shm=0, shared=True) == Route("ring", "ring")
    assert r(1 << 20, UNEVEN, "shm", small_shm=0) == Route("ring", "ring")
    # tuned across uneven nodes: no hierarchical candidate; below CROSS_NODE_TUNING_BYTES: fixed
    assert r(1 << 20, UNEVEN, small_shm=0, autotune=True) == Route("tuned", "auto", ("ring", "native"))
    below = plan.CROSS_NODE_TUNING_BYTES - 1
    assert r(below, TWO_NODES, small_shm=0, autotune=True) == Route("native", "native")
    assert r(64 << 20, TWO_NODES, small_shm=0, shared=True, autotune=True) == Route("zero-copy", "hierarchical")


@pytest.mark.parametrize("requested", ["auto", "ring", "native", "shm", "hierarchical"])
def test_one_rank_moves_no_data(requested):
    for nbytes in (0, 4, SMALL + 1, LARGE):
        got = r(nbytes, ONE, requested, small_shm=0, pipes=False, autotune=True)
        assert got.kind == "local" and got.algorithm == plan.choose_algorithm(nbytes, ONE, requested)


@given(st.integers(0, 2 * LARGE), st.sampled_from([NODE2, NODE3, TWO_NODES, UNEVEN, ONE]),
       st.sampled_from(plan.ALGORITHMS), st.booleans(), st.sampled_from([0, 4096, SMALL]), st.booleans(),
       st.booleans())
def test_route_agrees_with_the_fixed_choice_and_the_tuner(nbytes, topo, requested, shared, small, pipes, autotune):
    """The header names choose_algorithm's pick, or auto exactly where tuning_candidates offers
    a run-time choice; the kind follows from the algorithm."""
    if not topo.single_node:
        small = 0
    got = plan.route(nbytes, topo, requested, shared=shared, small_shm=small, pipes=pipes, autotune=autotune)
    fixed = plan.choose_algorithm(nbytes, topo, requested, shared, small)
    candidates = plan.tuning_candidates(nbytes, topo, small, pipes)
    if requested == "auto" and autotune and not shared and candidates:
        assert got == Route("tuned", "auto", candidates)
        return
    assert got.algorithm == fixed and not got.candidates
    if fixed == "shm" and 0 < nbytes <= small:
        assert got.kind == "flags"
    elif topo.size == 1 or nbytes == 0:
        assert got.kind == "local"
    elif shared and fixed in ("shm", "hierarchical"):
        assert got.kind == "zero-copy"
    elif fixed == "shm" and pipes:
        assert got.kind == "piped"
    else:
        assert got.kind == fixed


def test_a_route_validates_itself():
    with pytest.raises(ValueError, match="unknown route kind 'fast'"):
        Route("fast", "shm")
    with pytest.raises(ValueError, match="unknown algorithm"):
        Route("ring", "fast")
    with pytest.raises(ValueError, match="only 'tuned'"):
        Route("tuned", "auto")
    with pytest.raises(ValueError, match="only 'tuned'"):
        Route("ring", "ring", ("ring",))
