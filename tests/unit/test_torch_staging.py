"""CUDA tensors through MPI: the decision (MPI library's answer, HPCTRAIN_CUDA_AWARE_MPI) and
both branches, on CPU, with a tensor that reports itself as a CUDA tensor and the MPI
library's answer mocked; and the real query on this machine's MPI library."""
import pytest
import torch

from hpctrain import comm
from hpctrain.comm import device
from hpctrain.torch import backends, staging


class FakeCuda(torch.Tensor):
    """A CPU tensor that reports itself as a CUDA tensor (what staging looks at)."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 0)


def fake_cuda(values):
    return torch.as_tensor(values, dtype=torch.float32).as_subclass(FakeCuda)


@pytest.fixture
def fresh(monkeypatch, request):
    """A process that has not decided yet; the MPI library's answer is set by the test."""
    monkeypatch.setitem(staging._state, "cuda_aware", None)
    monkeypatch.setitem(staging._state, "logged", True)
    monkeypatch.setitem(device._state, "accept", None)
    monkeypatch.delenv(staging.ENV, raising=False)
    from hpctrain import settings

    settings.reset()  # the variable is read once per process: each test is a fresh one
    request.addfinalizer(settings.reset)
    answer = {"value": False, "asked": 0}

    def query():
        answer["asked"] += 1
        return answer["value"]

    monkeypatch.setattr(comm, "cuda_support", query)
    sent = []
    monkeypatch.setattr(comm, "allreduce_async", lambda buf, **kw: sent.append(buf) or "handle")
    return answer, sent


def test_cuda_aware_mpi_gets_the_gpu_tensor_itself(fresh):
    answer, sent = fresh
    answer["value"] = True
    t = fake_cuda([1.0, 2.0])
    host, restore = staging.to_host(t)
    assert host is t and restore(t) is t  # no staging copy
    assert backends.MPIBackend().allreduce_async(t, "sum") == "handle"
    assert sent == [t] and sent[0] is t
    assert device.accepts_device_buffers()  # hpctrain.comm then takes device tensors


def test_without_cuda_aware_mpi_the_tensor_is_staged_through_the_host(fresh):
    answer, sent = fresh
    t = fake_cuda([1.0, 2.0])
    host, _ = staging.to_host(t)
    assert host is not t and type(host) is torch.Tensor and host.device.type == "cpu"
    assert host.data_ptr() != t.data_ptr() and host.tolist() == [1.0, 2.0]
    work = backends.MPIBackend().allreduce_async(t, "sum")
    assert isinstance(work, backends._Staged) and work.target is t
    assert len(sent) == 1 and sent[0] is not t and type(sent[0]) is torch.Tensor
    assert not device.accepts_device_buffers()  # and hpctrain.comm refuses device tensors
    assert answer["asked"] == 1  # decided once


@pytest.mark.parametrize("value,mpi_says,expected", [
    ("1", False, True), ("on", False, True), ("0", True, False), ("false", True, False),
    ("auto", True, True), ("auto", False, False), ("", True, True), (" AUTO ", False, False)])
def test_override(fresh, monkeypatch, value, mpi_says, expected):
    answer, _ = fresh
    answer["value"] = mpi_says
    monkeypatch.setenv(staging.ENV, value)
    assert staging.cuda_aware_mpi() is expected
    assert answer["asked"] == (1 if value.strip().lower() in ("auto", "") else 0)
    assert (staging.to_host(fake_cuda([3.0]))[0].device.type == "cuda") is expected


@pytest.mark.parametrize("value", ["2", "maybe", "yes please"])
def test_bad_override_is_one_clear_error(fresh, monkeypatch, value):
    monkeypatch.setenv(staging.ENV, value)
    with pytest.raises(ValueError) as info:
        staging.cuda_aware_mpi()
    assert str(info.value).startswith(f"HPCTRAIN_CUDA_AWARE_MPI={value!r}: expected 1 or 0")
    assert "HINT: " in str(info.value)


def test_the_mpi_library_answers():
    """The real query against the MPI library mpi4py loaded: a bool, no crash (this machine's
    Open MPI wheel exports MPIX_Query_cuda_support)."""
    assert isinstance(device.query_cuda_support(), bool)
    assert isinstance(comm.cuda_support(), bool)


def test_mpich_gpu_switch_reads_as_not_cuda_aware(monkeypatch):
    monkeypatch.setenv("MPIR_CVAR_ENABLE_GPU", "0")
    assert device.query_cuda_support() is False


def test_comm_refuses_a_device_tensor_unless_accepted(monkeypatch):
    comm.init()
    monkeypatch.setitem(device._state, "accept", False)
    with pytest.raises(ValueError, match="hpctrain.comm takes CPU tensors, got one on cuda:0"):
        comm.allreduce_async(fake_cuda([1.0]).as_subclass(_NotCpu))
    monkeypatch.setitem(device._state, "accept", True)
    assert device.on_device(fake_cuda([1.0]).as_subclass(_NotCpu))
    assert not device.on_device(torch.ones(1))


class _NotCpu(FakeCuda):
    __module__ = "torch.fake"  # hpctrain.comm tells torch tensors by their type's module

    @property
    def is_cpu(self):
        return False
