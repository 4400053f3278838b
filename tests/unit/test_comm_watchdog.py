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


def test_launcher_parent_names_only_mpi_launchers(tmp_path):
    from hpctrain.comm.watchdog import launcher_parent

    for pid, name in ((11, "prterun"), (12, "prted"), (13, "hydra_pmi_proxy"), (14, "slurmstepd"), (15, "bash"),
                      (16, "starter-suid")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "comm").write_text(name + "\n")
    assert launcher_parent(11, str(tmp_path)) == (11, "prterun")
    assert launcher_parent(13, str(tmp_path)) == (13, "hydra_pmi_proxy")
    assert launcher_parent(14, str(tmp_path)) == (14, "slurmstepd")
    assert launcher_parent(15, str(tmp_path)) is None  # a shell: a singleton run by hand
    assert launcher_parent(16, str(tmp_path)) is None  # a container's starter: not watched
    assert launcher_parent(99, str(tmp_path)) is None  # gone, or no /proc


def test_a_rank_whose_launcher_is_gone_exits_with_a_report():
    """Re-parented (its launcher's pid is no longer its parent): the watchdog's thread says so
    and ends the process with status 1; with its launcher still there it runs on."""
    import subprocess
    import sys

    code = ("import time\n"
            "from hpctrain.comm.watchdog import Watchdog\n"
            "parent = [100]\n"
            "dog = Watchdog(3, lambda code: None, 0.5, parent=(100, 'prterun'), getppid=lambda: parent[0])\n"
            "dog.start()\n"
            "time.sleep(0.5)\n"
            "assert not dog.launcher_gone()\n"
            "print('still running', flush=True)\n"
            "parent[0] = 1\n"
            "time.sleep(10)\n"
            "print('not ended')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "still running" in done.stdout and "not ended" not in done.stdout
    assert "rank 3: the MPI launcher that started it (prterun, pid 100) is gone" in done.stderr
    assert "HINT" in done.stderr
    unwatched = watchdog.Watchdog(0, lambda code: None, 1.0)
    assert not unwatched.launcher_gone()  # no launcher parent known: never orphaned
