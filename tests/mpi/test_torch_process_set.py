"""DistributedOptimizer(process_set=...): gradients are averaged within the set only.

At 4 ranks the sets are {0, 1} and {2, 3}; at 2 ranks {0} and {1} (one-rank sets: nothing to
average). Each rank's gradient is a known function of its world rank, so the expected average
of each set is computed here from the set's ranks."""
import pytest
import torch

import hpctrain.torch as hvd
from hpctrain import comm

RANKS = (2, 4)
TIMEOUT = 240

hvd.init()
R, N = hvd.rank(), hvd.size()
torch.set_num_threads(1)
HALF = max(1, N // 2)
MINE = [r for r in range(N) if r // HALF == R // HALF]  # ranks of this rank's set


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def _grads_of(rank, model):
    """Gradient of world rank ``rank``: a plain loss on rank-dependent inputs."""
    m = _model()
    m.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(50 + rank)
    m(torch.randn(5, 3, generator=g, dtype=torch.float64)).pow(2).sum().backward()
    return [p.grad.clone() for p in m.parameters()]


def _expected(model):
    per_rank = [_grads_of(r, model) for r in MINE]
    return [sum(gs) / len(MINE) for gs in zip(*per_rank)]


_SETS = []


def _process_sets():
    """The two sets, registered once on every rank in the same order (add_process_set is
    collective and, as in Horovod, refuses to register the same ranks twice)."""
    if not _SETS:
        _SETS.extend(hvd.add_process_set([r for r in range(N) if r // HALF == k])
                     for k in range((N + HALF - 1) // HALF))
    return _SETS[R // HALF]


@pytest.mark.parametrize("kind", ["comm_group", "process_set"])
@pytest.mark.parametrize("threshold", [0, 1 << 20])
def test_average_only_within_set(kind, threshold):
    ps = comm.split(color=R // HALF, key=R) if kind == "comm_group" else _process_sets()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), fusion_threshold=threshold,
                                   process_set=ps)
    expected = _expected(model)
    g = torch.Generator().manual_seed(50 + R)
    model(torch.randn(5, 3, generator=g, dtype=torch.float64)).pow(2).sum().backward()
    opt.synchronize()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-12)
    with opt.skip_synchronize():
        opt.step()
    # The two sets now hold different weights (different averages), members of one set the same.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = comm.allgather_object(flat)
    for r in range(N):
        same_set = r // HALF == R // HALF
        assert torch.equal(everyone[r], flat) == same_set, (r, same_set)


def test_parameter_server_rank_is_a_set_rank():
    ps = comm.split(color=R // HALF, key=R)
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), process_set=ps,
                                   sync=f"parameter_server:{ps.size - 1}")
    expected = _expected(model)
    g = torch.Generator().manual_seed(50 + R)
    model(torch.randn(5, 3, generator=g, dtype=torch.float64)).pow(2).sum().backward()
    ref = _model()
    ref.load_state_dict(model.state_dict())
    opt.step()
    with torch.no_grad():
        for p, q, e in zip(model.parameters(), ref.parameters(), expected):
            torch.testing.assert_close(p, q - 0.5 * e, rtol=1e-12, atol=1e-12)


def test_unregistered_set_and_other_backend_are_errors():
    model = _model()
    with pytest.raises(ValueError, match="not registered"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=hvd.ProcessSet([0]))
    with pytest.raises(TypeError, match="process_set must be"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=[0, 1])
    ps = comm.split(color=R // HALF, key=R)
    with pytest.raises(ValueError, match="only the 'mpi' backend"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=ps, backend="gloo")
