"""Pure planning code of hpctrain.comm: ring schedule, chunks, topology, algorithm choice."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hpctrain.comm import plan
from hpctrain.comm.launcher import check_non_mpi_launcher, check_world_size, detect_launcher, expected_world_size
from hpctrain.comm.errors import WorldSizeError


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_chunk_bounds_cover_in_order_and_balance(length, parts):
    bounds = plan.chunk_bounds(length, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def simulate_ring(values, seg=3):
    """Run every rank's plan.ring_schedule in one process, exactly as ring_ does."""
    n, length = len(values), len(values[0])
    bufs = [np.array(v, dtype=np.int64) for v in values]
    scheds = [plan.ring_schedule(length, n, r, seg) for r in range(n)]
    for r, s in enumerate(scheds):
        assert (s.left, s.right) == plan.ring_neighbors(r, n)
        assert s.max_chunk == max(b - a for a, b in plan.chunk_bounds(length, n))
    for phase in ("reduce_scatter", "allgather"):
        for step in range(n - 1):
            sent = {}
            for r, s in enumerate(scheds):
                st_ = getattr(s, phase)[step]
                a, b = st_.send
                assert st_.single == (b - a <= seg and st_.recv[1] - st_.recv[0] <= seg)
                sent[s.right] = ((a, b), bufs[r][a:b].copy())
            for r, s in enumerate(scheds):
                st_ = getattr(s, phase)[step]
                bounds, data = sent[r]
                assert bounds == st_.recv, "receiver expects the chunk its left neighbour sends"
                a, b = st_.recv
                if phase == "reduce_scatter":
                    bufs[r][a:b] += data
                else:
                    bufs[r][a:b] = data
    for r, s in enumerate(scheds):  # after the reduce-scatter each rank owned one chunk
        assert s.owned == plan.chunk_bounds(length, n)[plan.owned_chunk(r, n)]
    return bufs


@settings(max_examples=200)
@given(st.integers(1, 9), st.integers(0, 40), st.integers(0, 2**16))
def test_ring_schedule_reduces_everything_on_every_rank(n, length, seed):
    rng = np.random.default_rng(seed)
    values = [rng.integers(-100, 100, size=length) for _ in range(n)]
    expected = np.sum(values, axis=0) if length else np.zeros(0)
    for buf in simulate_ring(values):
        np.testing.assert_array_equal(buf, expected)


@given(st.integers(1, 9))
def test_each_rank_owns_a_distinct_chunk(n):
    assert sorted(plan.owned_chunk(r, n) for r in range(n)) == list(range(n))
    for r in range(n):
        left, right = plan.ring_neighbors(r, n)
        assert plan.ring_neighbors(right, n)[0] == r and plan.ring_neighbors(left, n)[1] == r


def test_segments_split_and_reject_zero():
    assert plan.segments(10, 25, 8) == [(10, 18), (18, 25)]
    assert plan.segments(5, 5, 8) == []
    with pytest.raises(ValueError):
        plan.segments(0, 10, 0)


def test_bad_ranks_are_rejected():
    with pytest.raises(ValueError, match="not in a world of size 3"):
        plan.reduce_scatter_step(3, 3, 0)
    with pytest.raises(ValueError):
        plan.chunk_bounds(10, 0)


def test_topology_from_hostnames():
    topo = plan.topology_from_keys(["b", "b", "a", "a"])
    assert topo.node_of == (0, 0, 1, 1)
    assert [topo.local_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [topo.cross_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert topo.cross_size == 2 and topo.homogeneous and not topo.single_node
    uneven = plan.topology_from_keys(["a", "a", "b"])
    assert not uneven.homogeneous and uneven.local_size(2) == 1


@pytest.mark.parametrize("nbytes,keys,requested,expected", [
    (1024, ["a", "a"], "auto", "native"),
    (64 << 20, ["a", "a"], "auto", "ring"),
    (1 << 20, ["a", "a"], "auto", "native"),
    (64 << 20, ["a", "a", "b", "b"], "auto", "hierarchical"),
    (64 << 20, ["a", "a", "b"], "auto", "ring"),
    (1024, ["a", "a", "b", "b"], "auto", "native"),
    (64 << 20, ["a"], "auto", "native"),
    (64 << 20, ["a", "b"], "shm", "hierarchical"),       # shm never spans nodes
    (64 << 20, ["a", "a", "b"], "shm", "ring"),
    (64 << 20, ["a", "a"], "hierarchical", "shm"),
    (64 << 20, ["a", "a"], "ring", "ring"),
])
def test_choose_algorithm(nbytes, keys, requested, expected):
    assert plan.choose_algorithm(nbytes, plan.topology_from_keys(keys), requested) == expected


def test_shared_buffers_go_zero_copy_from_small_sizes():
    topo = plan.topology_from_keys(["a", "a"])
    assert plan.choose_algorithm(64 << 10, topo, shared=True) == "shm"
    assert plan.choose_algorithm(1 << 10, topo, shared=True) == "native"
    assert plan.choose_algorithm(64 << 20, plan.topology_from_keys(["a", "a", "b", "b"]), shared=True) == "hierarchical"


def test_choose_algorithm_rejects_unknown():
    with pytest.raises(ValueError, match="valid: auto, ring"):
        plan.choose_algorithm(1, plan.topology_from_keys(["a"]), "fast")


@pytest.mark.parametrize("text,value", [("4096", 4096), ("64KiB", 65536), ("1MiB", 1 << 20), ("1MB", 1 << 20),
                                        ("2 GiB", 2 << 30)])
def test_parse_size(text, value):
    assert plan.parse_size(text) == value
    assert plan.parse_size(plan.format_size(value)) == value


def test_parse_size_error_gives_examples():
    with pytest.raises(ValueError, match="e.g. 512KiB, 1MiB"):
        plan.parse_size("lots")


def test_world_size_check_catches_silent_singletons():
    srun = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}
    assert detect_launcher(srun) == "srun" and expected_world_size(srun) == 2
    with pytest.raises(WorldSizeError, match="srun --mpi=pmix"):
        check_world_size(srun, 1)
    check_world_size(srun, 2)
    # under mpirun inside an allocation the SLURM variables describe mpirun's daemons
    check_world_size({**srun, "OMPI_COMM_WORLD_SIZE": "4", "SLURM_STEP_NUM_TASKS": "1"}, 4)
    # a plain python in the batch script (no step) is not checked
    check_world_size({"SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}, 1)


def test_other_launchers_starting_one_rank_worlds_are_refused():
    gloo = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1"}
    with pytest.raises(WorldSizeError, match="horovodrun's Gloo launcher .HOROVOD_SIZE=2"):
        check_non_mpi_launcher(gloo, 1)
    torchrun = {"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "h", "TORCHELASTIC_RUN_ID": "x"}
    with pytest.raises(WorldSizeError, match="torchrun"):
        check_non_mpi_launcher(torchrun, 1)
    check_non_mpi_launcher(gloo, 2)  # a real MPI world: the variables are someone else's business
    check_non_mpi_launcher({"HOROVOD_SIZE": "1"}, 1)
    check_non_mpi_launcher({"WORLD_SIZE": "2"}, 1)  # no torchrun marker: not ours to judge


def test_the_check_pairs_ranks_by_recursive_doubling_with_extra_ranks_folded_in():
    from hpctrain.comm.plan import check_schedule

    assert check_schedule(0, 4) == (-1, (), (1, 2), 2, (), 0)  # one node, or no nodes given: every rank a core one
    assert check_schedule(3, 4) == (-1, (), (2, 1), 2, (), 0)
    assert check_schedule(0, 3) == (-1, (2,), (1,), 1, (0,), 0) and check_schedule(2, 3) == (0, (), (), 1, (), 0)
    assert check_schedule(1, 7)[:3] == (-1, (5,), (0, 3)) and check_schedule(3, 7).extras == ()
    assert check_schedule(1, 4, (0, 0, 0, 0)) == check_schedule(1, 4)
    assert check_schedule(1, 3, (0, 1, 2)) == check_schedule(1, 3)  # one rank per node: the same


def test_across_nodes_a_nodes_ranks_fold_into_its_leader_and_only_leaders_pair_up():
    from hpctrain.comm.plan import check_schedule, check_transfers

    two_by_two = (0, 0, 1, 1)
    assert [check_schedule(r, 4, two_by_two)[:4] for r in range(4)] == [
        (-1, (1,), (2,), 1), (0, (), (), 1), (-1, (3,), (0,), 1), (2, (), (), 1)]
    # three nodes: leaders 0, 3, 5; the third leader folds (with its node) into the first
    seven = (0, 0, 0, 1, 1, 2, 2)
    assert check_schedule(0, 7, seven) == (-1, (1, 2, 5), (3,), 1, (0, 0, 1), 3)
    assert check_schedule(5, 7, seven) == (0, (6,), (), 1, (0,), 3) and check_schedule(6, 7, seven)[:4] == (5, (), (), 1)
    # ranks dealt to the nodes in turn: the leaders are each node's lowest rank
    assert check_schedule(0, 4, (0, 1, 0, 1))[:4] == (-1, (2,), (1,), 1)
    assert check_schedule(3, 4, (0, 1, 0, 1))[:4] == (1, (), (), 1)
    # eight ranks on a node: a binomial tree (rank 0 takes 1, 2 and 4; 4 takes 5 and 6; 6 takes 7)
    blocks = tuple(r // 8 for r in range(16))
    tree = [check_schedule(r, 16, blocks) for r in range(8)]
    assert [(s.home, s.extras) for s in tree] == [(-1, (1, 2, 4)), (0, ()), (0, (3,)), (2, ()), (0, (5, 6)),
                                                  (4, ()), (4, (7,)), (6, ())]
    assert tree[0].partners == (8,) and tree[0].extra_heights == (0, 1, 2) and tree[4].extra_heights == (0, 1)
    assert check_transfers(16, blocks) == 4  # three tree levels and one step
    assert check_transfers(4, two_by_two) == 2 and check_transfers(7, seven) == 4
    assert check_transfers(4) == 2 and check_transfers(5) == 3 and check_transfers(1) == 0
    with pytest.raises(ValueError, match="node_of"):
        check_schedule(0, 4, (0, 1))


def _layouts():
    yield from ((size, None) for size in range(2, 34))
    yield from ((size, tuple(r // per for r in range(size))) for size in range(2, 34) for per in (2, 3, 8))
    yield from ((size, tuple(r % nodes for r in range(size))) for size in range(2, 20) for nodes in (2, 3))


@pytest.mark.parametrize("size,node_of", list(_layouts()))
def test_every_check_message_has_a_matching_receive(size, node_of):
    """Each step pairs core ranks both ways, every other rank has exactly one home that lists
    it among its extras (and folds in no cycle), after the last step every core rank has
    (through its partners) merged every core rank's part, and every rank's part reaches the
    core; check_transfers is the most parts a rank receives."""
    from hpctrain.comm.plan import check_schedule, check_transfers

    schedules = [check_schedule(r, size, node_of) for r in range(size)]
    core = [r for r, s in enumerate(schedules) if s.home < 0]
    assert 0 in core and len(core) & (len(core) - 1) == 0
    for r, s in enumerate(schedules):
        if s.home >= 0:
            assert s.partners == () and schedules[s.home].extras.count(r) == 1
        for extra in s.extras:
            assert schedules[extra].home == r
        for step, partner in enumerate(s.partners):
            assert schedules[partner].partners[step] == r
    def gathered(r):
        return {r}.union(*(gathered(e) for e in schedules[r].extras))
    known = {r: gathered(r) for r in core}
    for step in range(schedules[0].steps):
        known = {r: known[r] | known[schedules[r].partners[step]] for r in core}
    assert all(known[r] == set(range(size)) for r in core)
    assert check_transfers(size, node_of) == max(len(s.extras) + len(s.partners) for s in schedules)
    # a rank waiting for an extra waits less long before its stall report than the extra's own
    # waits, and any wait for an extra less long than a wait at a step (levels + stage)
    for r, s in enumerate(schedules):
        assert len(s.extra_heights) == len(s.extras)
        for extra, height in zip(s.extras, s.extra_heights):
            assert all(h < height for h in schedules[extra].extra_heights)
            assert height < s.levels or s.levels == 0 == height
