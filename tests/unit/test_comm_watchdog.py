"""The stall watchdog's clocked waits (``ClockedWait``): blocking calls in C that time
themselves. The C side (the clock written while the in-band call waits) is in
test_mpiring_ext.py; under mpiexec, tests/test_comm_faults.py stalls the in-band call itself."""
import gc
import time

from hpctrain.comm import watchdog


def _dog(timeout=0.1):
    aborted = []
    return watchdog.Watchdog(0, aborted.append, timeout), aborted


def _wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_clocked_call_waiting_past_the_timeout_is_reported_with_its_missing_ranks(capsys):
    dog, aborted = _dog()
    wait = dog.clocked(lambda: "allreduce(sum, float32, 4 elements) on world (agreement check)", lambda: "ranks 2")
    wait.clock[0] = time.monotonic() - 1.0  # as the C call writes it when it begins
    dog.start()
    assert _wait_for(lambda: aborted), "the watchdog never fired"
    dog.stop()
    assert aborted == [3]
    message = dog.fired[0]
    assert "allreduce(sum, float32, 4 elements) on world (agreement check) has waited" in message
    assert "Not arrived: ranks 2." in message and "STALL on rank 0" in capsys.readouterr().err


def test_a_clocked_wait_between_calls_is_not_watched():
    dog, aborted = _dog()
    wait = dog.clocked("allreduce on world", lambda: "ranks 1")
    dog.start()
    time.sleep(0.5)  # five timeouts with no call in progress (clock 0.0)
    wait.clock[0] = time.monotonic()  # a call begins and ends within the timeout
    wait.clock[0] = 0.0
    time.sleep(0.3)
    dog.stop()
    assert aborted == [] and dog.fired == []


def test_a_dropped_clocked_wait_leaves_the_watchdog():
    dog, _ = _dog()
    wait = dog.clocked("allreduce on world", lambda: "ranks 1")
    wait.clock[0] = 1.0
    assert dog._watched() == [wait]
    del wait
    gc.collect()
    assert dog._watched() == [] and dog._clocked == {}


def test_a_clocked_call_the_revoke_did_not_end_aborts_at_its_next_stall(monkeypatch):
    """Elastic jobs: the hook turns the first stall into a lost rank (the count restarts for
    the same call); the same call still waiting a timeout later aborts."""
    asked = []

    def hook(what, waited, missing):
        asked.append(what)
        return True

    monkeypatch.setitem(watchdog.ON_STALL, "fn", hook)
    dog, aborted = _dog()
    wait = dog.clocked("allreduce on world", lambda: "ranks 1")
    wait.clock[0] = time.monotonic() - 1.0
    dog.start()
    assert _wait_for(lambda: aborted)
    dog.stop()
    assert asked == ["allreduce on world"] * 2 and aborted == [3]


def test_a_new_call_after_a_diverted_one_is_counted_from_its_own_start():
    dog, _ = _dog(timeout=100)
    wait = dog.clocked("allreduce on world", lambda: "ranks 1")
    wait.clock[0] = 5.0
    wait.since = 50.0  # the watchdog restarted the count of the call that began at 5.0
    assert wait.since == 50.0
    wait.clock[0] = 60.0  # the next call
    assert wait.since == 60.0
    wait.clock[0] = 0.0
    assert wait.since is None
