"""The pure fits of ``hpctrain bench calibrate``: measured times back to link parameters."""
import pytest

torch = pytest.importorskip("torch")

from hpctrain.bench.calibrate import fit_line, shm_link_from_times  # noqa: E402
from hpctrain.scaling.model import shm_time  # noqa: E402
from hpctrain.scaling.fabrics import Link  # noqa: E402

SIZES = (64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


def test_fit_line_recovers_alpha_and_beta():
    a, s = fit_line([1, 2, 3], [3e-6 + 1e-9, 3e-6 + 2e-9, 3e-6 + 3e-9])
    assert a == pytest.approx(3e-6) and s == pytest.approx(1e-9)


def test_shm_fit_inverts_the_models_form():
    link = Link(4e-6, 6e9)
    times = [shm_time(n // 4, 4, 4, link, 10e9) for n in SIZES]
    got = shm_link_from_times(SIZES, times, 4, 10e9)
    assert got.alpha_s == pytest.approx(4e-6, rel=1e-3) and got.bandwidth_Bps == pytest.approx(6e9, rel=1e-3)


def test_flat_noisy_times_give_a_finite_bandwidth_from_the_largest_size():
    got = shm_link_from_times(SIZES, [0.066, 0.066, 0.065], 2, 18e9)
    assert got.bandwidth_Bps == pytest.approx(2 * SIZES[-1] / 0.065)
