"""When a rank waiting on the node's flags spins before yielding its core (pure decision)."""
import pytest

from hpctrain.comm.shmsync import spins


@pytest.mark.parametrize("cores,ranks,env,want", [
    (2, 2, {}, True),                                          # a core each
    (2, 3, {}, False),                                         # more ranks than cores
    (2, 2, {"OMPI_MCA_mpi_yield_when_idle": "1"}, False),      # told: the cores are shared
    (8, 2, {"OMPI_MCA_mpi_yield_when_idle": " true "}, False),
    (2, 2, {"OMPI_MCA_mpi_yield_when_idle": "0"}, True),
])
def test_auto_spins_only_where_every_rank_has_a_core_and_mpi_was_not_told_to_yield(cores, ranks, env, want):
    assert spins(cores, ranks, None, env) is want


def test_the_setting_wins_either_way():
    assert spins(1, 4, True, {}) is True
    assert spins(64, 2, False, {}) is False
    assert spins(1, 4, True, {"OMPI_MCA_mpi_yield_when_idle": "1"}) is True
