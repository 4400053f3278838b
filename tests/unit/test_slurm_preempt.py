"""hpctrain.slurm.preempt: signals set a flag; nothing else happens until the loop polls."""
import os
import signal
import subprocess

import pytest

from hpctrain.slurm import preempt


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_sets_flag_and_uninstall_restores(sig):
    before = signal.getsignal(sig)
    with preempt.PreemptionGuard() as guard:
        assert not guard.should_stop() and guard.received is None
        os.kill(os.getpid(), sig)
        assert guard.should_stop() and guard.received == sig
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal keeps the first one
        assert guard.received == sig
    assert signal.getsignal(sig) is before


def test_agree_combines_ranks():
    guard = preempt.PreemptionGuard()
    seen = []

    def agree(flag):  # stands in for an all-reduce(max) over the ranks
        seen.append(flag)
        return True

    assert guard.should_stop(agree=agree) is True and seen == [False]
    guard.request_stop()
    assert guard.should_stop() and guard.received == signal.SIGUSR1


def test_any_rank_single_process_is_local_flag():
    agree = preempt.any_rank()
    assert agree(True) is True and agree(False) is False


def fake_run(rc, out="", err=""):
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, rc, out, err)

    return run, calls


def test_requeue_rank0_calls_scontrol():
    run, calls = fake_run(0)
    guard = preempt.PreemptionGuard()
    assert guard.requeue(rank=0, env={"SLURM_JOB_ID": "77"}, run=run) is True
    assert calls == [["scontrol", "requeue", "77"]]
    assert guard.requeue(rank=1, env={"SLURM_JOB_ID": "77"}, run=run) is False
    assert len(calls) == 1  # other ranks never call it


def test_requeue_refused_or_outside_slurm(caplog):
    run, calls = fake_run(1, err="Requested operation is presently disabled")
    with caplog.at_level("ERROR", logger="hpctrain.slurm"):
        assert preempt.requeue_job(env={"SLURM_JOB_ID": "5"}, run=run) is False
    assert "presently disabled" in caplog.text and "HINT" in caplog.text
    assert preempt.requeue_job(env={}, run=run) is False and len(calls) == 1

    def missing(argv, **kw):
        raise FileNotFoundError("scontrol")

    assert preempt.requeue_job(env={"SLURM_JOB_ID": "5"}, run=missing) is False


def test_needs_a_signal():
    with pytest.raises(ValueError, match="at least one signal"):
        preempt.PreemptionGuard(signals=())
