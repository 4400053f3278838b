"""Adasum's pure part: the pairwise formula, the tree, and the halving/doubling schedule run for
every rank in one process."""
import numpy as np
import pytest

from hpctrain.comm import adasum_plan as ap


def simulate(vectors, sizes, dtype=np.float64):
    """Every rank walks ``ap.schedule`` in lockstep, as ``comm.adasum`` does over MPI (the
    block sums added directly instead of by recursive doubling)."""
    size = len(vectors)
    total = vectors[0].size
    bounds = ap.offsets(sizes)
    bufs = [np.array(v, dtype=dtype).reshape(-1) for v in vectors]
    plans = [ap.schedule(r, size, total) for r in range(size)]
    for k in range(len(plans[0])):
        received, sums = [], []
        for r in range(size):
            lv = plans[r][k]
            nb = plans[lv.neighbor][k]
            assert nb.keep == lv.give and nb.give == lv.keep and nb.left != lv.left
            lo, hi = lv.keep
            received.append(bufs[lv.neighbor][lo:hi].copy())
            sums.append(ap.segment_sums(bufs[r][lo:hi], received[r], lo, bounds, lv.left))
        distance = plans[0][k].distance
        for step in range(len(ap.block_partners(0, distance))):  # recursive doubling, all ranks in lockstep
            partner = [ap.block_partners(r, distance)[step] for r in range(size)]
            sums = [sums[r] + sums[partner[r]] for r in range(size)]
        for r in range(size):
            lv = plans[r][k]
            lo, hi = lv.keep
            ap.scaled_add_(bufs[r][lo:hi], received[r], lo, bounds, sums[r], lv.left)
    for k in reversed(range(len(plans[0]))):
        sent = [(plans[r][k], bufs[r][slice(*plans[r][k].keep)].copy()) for r in range(size)]
        for r in range(size):
            lv, data = sent[plans[r][k].neighbor]
            bufs[r][slice(*lv.keep)] = data
    return bufs


def test_combine_formula_by_hand():
    a, b = np.array([1.0, 0.0]), np.array([1.0, 1.0])
    # a·b = 1, |a|² = 1, |b|² = 2: (1 - 1/2) a + (1 - 1/4) b
    assert np.allclose(ap.combine(a, b), 0.5 * a + 0.75 * b)


def test_properties():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(7)
    assert np.allclose(ap.combine(a, a), a)                      # Adasum(a, a) = a
    assert np.allclose(ap.combine(a, 3 * a), 2 * a)              # parallel: (1-3/2)a + (1-1/6)3a = 2a
    e1, e2 = np.array([2.0, 0.0, 0.0]), np.array([0.0, -5.0, 0.0])
    assert np.allclose(ap.combine(e1, e2), e1 + e2)              # orthogonal: sum
    assert np.allclose(ap.combine(a, np.zeros(7)), a)            # a zero vector adds nothing
    b = rng.standard_normal(7)
    assert np.allclose(ap.combine(a, b), ap.combine(b, a))


def test_tree_of_four_equals_hand_pairing():
    rng = np.random.default_rng(1)
    v = [rng.standard_normal(5) for _ in range(4)]
    by_hand = ap.combine(ap.combine(v[0], v[1]), ap.combine(v[2], v[3]))
    assert np.allclose(ap.reference(v), by_hand)
    # two tensors of 2 and 3 elements: each gets its own coefficients
    two = np.concatenate([ap.combine(ap.combine(v[0][:2], v[1][:2]), ap.combine(v[2][:2], v[3][:2])),
                          ap.combine(ap.combine(v[0][2:], v[1][2:]), ap.combine(v[2][2:], v[3][2:]))])
    assert np.allclose(ap.reference(v, [2, 3]), two)
    assert not np.allclose(two, by_hand)


def test_block_partners_reach_the_block():
    # after the exchanges with rank ^ 1, rank ^ 2 … rank ^ distance, a rank has summed the
    # 2 * distance ranks that share rank // (2 * distance)
    for rank in range(16):
        for distance in (1, 2, 4, 8):
            reached = {rank}
            for p in ap.block_partners(rank, distance):
                reached |= {q ^ rank ^ p for q in reached}
            assert reached == {q for q in range(16) if q // (2 * distance) == rank // (2 * distance)}


def test_schedule_halves_and_covers():
    levels = ap.schedule(5, 8, 11)
    assert [lv.distance for lv in levels] == [1, 2, 4]
    assert [lv.neighbor for lv in levels] == [4, 7, 1]
    assert levels[0].keep == (5, 11) and levels[0].give == (0, 5)      # odd rank: the second half
    finals = sorted(ap.schedule(r, 8, 11)[-1].keep for r in range(8))  # the last ranges tile the buffer
    assert finals[0][0] == 0 and finals[-1][1] == 11
    assert all(x[1] == y[0] for x, y in zip(finals, finals[1:]))
    assert ap.schedule(0, 1, 4) == ()


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("sizes", [[1], [5], [3, 1, 4], [2, 0, 7, 1], [1, 1]])
def test_schedule_equals_tree(size, sizes):
    rng = np.random.default_rng(size * 100 + len(sizes))
    total = sum(sizes)
    vectors = [rng.standard_normal(total) for _ in range(size)]
    if size >= 2:
        vectors[1] = vectors[0].copy()            # equal and zero vectors: the guards
    if size >= 4:
        vectors[3][:] = 0.0
    expected = ap.reference(vectors, sizes)
    for buf in simulate(vectors, sizes):
        assert np.allclose(buf, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 2e-2)])
def test_schedule_in_lower_precision(dtype, tol):
    rng = np.random.default_rng(7)
    vectors = [rng.standard_normal(9).astype(dtype) for _ in range(4)]
    expected = ap.reference(vectors, [4, 5])
    for buf in simulate(vectors, [4, 5], dtype):
        assert buf.dtype == dtype
        assert np.allclose(buf, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("scale", [1e-38, 1e-10])
def test_tiny_float32_vectors_are_combined_not_summed(scale):
    """Horovod's test_stability: equal float32 vectors of ~1e-38 (|a|² ~ 1e-73) average to
    themselves; only a squared norm below sqrt(DBL_MIN) counts as a zero vector."""
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(16) * scale).astype(np.float32)
    for buf in simulate([a, a.copy()], [16], np.float32):
        assert np.allclose(buf, a, rtol=1e-5, atol=0)
    assert np.allclose(ap.combine(a, np.zeros(16)), a, rtol=1e-6, atol=0)  # a true zero still adds nothing


def test_non_power_of_two_refused():
    with pytest.raises(ValueError, match="power-of-two"):
        ap.schedule(0, 3, 10)
    with pytest.raises(ValueError, match="power-of-two"):
        ap.reference([np.ones(2)] * 3)
    assert [ap.is_power_of_two(n) for n in range(1, 9)] == [True, True, False, True, False, False, False, True]
