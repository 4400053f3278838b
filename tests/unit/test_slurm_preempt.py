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


def fake_run(rc, out="", err="", shows=()):
    """scontrol stand-in: `requeue` answers rc/out/err; each `show job` answers the next of
    ``shows`` (a dict of fields, or None for a failed call), the last one repeating."""
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        if argv[1] == "show":
            i = sum(1 for c in calls if c[1] == "show") - 1
            info = shows[min(i, len(shows) - 1)] if shows else None
            if info is None:
                return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Socket timed out")
            return subprocess.CompletedProcess(argv, 0, " ".join(f"{k}={v}" for k, v in info.items()), "")
        return subprocess.CompletedProcess(argv, rc, out, err)

    return run, calls


def no_sleep(waits):
    return lambda s: waits.append(s)


REQUEUED = {"JobId": "77", "JobState": "COMPLETING", "Restarts": "1"}
STILL_RUNNING = {"JobId": "77", "JobState": "RUNNING", "Restarts": "0"}


def test_requeue_rank0_calls_scontrol_and_sees_it_taken():
    run, calls = fake_run(0, shows=[REQUEUED])
    guard = preempt.PreemptionGuard()
    assert guard.requeue(rank=0, env={"SLURM_JOB_ID": "77"}, run=run) is True
    assert calls == [["scontrol", "requeue", "77"], ["scontrol", "show", "job", "77"]]
    assert guard.requeue(rank=1, env={"SLURM_JOB_ID": "77"}, run=run) is False
    assert len(calls) == 2  # other ranks never call it


def test_requeue_waits_until_slurm_shows_it():
    # scontrol killed by the requeue's SIGTERM, then still the old run, then requeued.
    waits = []
    run, calls = fake_run(0, shows=[None, STILL_RUNNING, {"JobState": "PENDING", "Restarts": "1"}])
    assert preempt.requeue_job(env={"SLURM_JOB_ID": "77"}, run=run, sleep=no_sleep(waits)) is True
    assert len(calls) == 4 and len(waits) == 2


def test_requeue_accepted_but_not_taken_is_an_error(caplog):
    waits = []
    run, _ = fake_run(0, shows=[STILL_RUNNING])
    with caplog.at_level("ERROR", logger="hpctrain.slurm"):
        assert preempt.requeue_job(env={"SLURM_JOB_ID": "77"}, run=run, confirm_timeout=2.0,
                                   sleep=no_sleep(waits)) is False
    assert "still shows JobState=RUNNING Restarts=0" in caplog.text and "HINT" in caplog.text
    assert abs(sum(waits) - 2.0) < 0.15  # waited the whole confirm_timeout, no longer


def test_requeue_unconfirmable_when_scontrol_show_never_answers(caplog):
    run, _ = fake_run(0, shows=[None])
    with caplog.at_level("WARNING", logger="hpctrain.slurm"):
        assert preempt.requeue_job(env={"SLURM_JOB_ID": "77"}, run=run, confirm_timeout=1.0,
                                   sleep=no_sleep([])) is True
    assert "cannot confirm the requeue" in caplog.text


@pytest.mark.parametrize("info, before, taken", [
    ({"JobState": "COMPLETING", "Restarts": "1"}, 0, True),
    ({"JobState": "RUNNING", "Restarts": "2"}, 1, True),   # the rerun already started
    ({"JobState": "REQUEUED", "Restarts": "0"}, 0, True),
    ({"JobState": "RUNNING", "Restarts": "1"}, 1, False),
    ({"JobState": "COMPLETED", "Restarts": "0"}, 0, False),
    ({"JobState": "RUNNING", "Restarts": "x"}, 0, False),
    ({}, 0, False),
])
def test_requeue_taken(info, before, taken):
    assert preempt.requeue_taken(info, before) is taken


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
