"""Ranks that end early (finished.py): the pure decision, the report, and the watchdog that
acts on the notices. Under mpiexec, tests/test_comm_faults.py ends a rank early for real."""
import time

from hpctrain.comm import finished, watchdog


class FakeNotices:
    """``finished.Notices.poll`` without MPI: the ranks that have ended so far."""

    def __init__(self):
        self.ended = {}

    def poll(self):
        return dict(self.ended)


def _listening_dog(started, timeout=60.0):
    aborted = []
    dog = watchdog.Watchdog(0, aborted.append, timeout)
    notices = FakeNotices()
    dog.listen(notices, lambda: started[0])
    return dog, notices, aborted


def _wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_only_ranks_that_ended_before_this_collective_count():
    assert finished.never_started({}, 5) == []
    assert finished.never_started({1: 5, 2: 6}, 5) == []  # they were in it, or past it
    assert finished.never_started({3: 4, 1: 2, 2: 5}, 5) == [(1, 2), (3, 4)]


def test_the_report_names_the_ranks_their_counts_and_the_collective():
    one = finished.describe([(1, 3)], 4, "allreduce(sum, float32, 4 elements) [collective #4] on world")
    assert one.startswith("allreduce(sum, float32, 4 elements) [collective #4] on world cannot finish: rank 1 has "
                          "ended (shutdown() or a normal exit) after 3 collective(s) on the world, where this rank "
                          "has started 4.")
    assert "HINT: every rank must make the same collective calls" in one and one.endswith("Aborting the job.")
    two = finished.describe([(1, 3), (4, 2)], 4, "barrier on world")
    assert "ranks 1, 4 have ended (shutdown() or a normal exit) after 3, 2 collective(s)" in two


def test_a_rank_that_ended_early_aborts_the_job_within_the_grace(capsys):
    started = [7]
    dog, notices, aborted = _listening_dog(started)
    dog.start()
    with dog.watch(lambda: "allgather(float32) [collective #7] on world", lambda: "ranks 1"):
        t0 = time.monotonic()
        notices.ended[1] = 6
        assert _wait_for(lambda: aborted), "the watchdog never reported the ended rank"
        took = time.monotonic() - t0
    dog.stop()
    assert aborted == [3]
    assert finished.GRACE_SECONDS <= took < finished.GRACE_SECONDS + 3.0, took
    assert "hpctrain: rank 0: allgather(float32) [collective #7] on world cannot finish: rank 1 has ended" in \
        capsys.readouterr().err


def test_a_rank_that_ended_after_the_same_collectives_is_not_reported():
    started = [7]
    dog, notices, aborted = _listening_dog(started)
    notices.ended[1] = 7  # it made collective #7 too: this rank's wait will end
    dog.start()
    with dog.watch("allreduce [collective #7] on world", lambda: "ranks 1"):
        time.sleep(finished.GRACE_SECONDS + 1.5)
    dog.stop()
    assert aborted == [] and dog.fired == []


def test_without_a_watched_wait_the_count_alone_decides():
    """The shared-memory flag waits time themselves in C, unseen by the watchdog: a rank that
    ended before this rank's current collective is still reported, naming the collective."""
    started = [3]
    dog, notices, aborted = _listening_dog(started)
    notices.ended[2] = 2
    dog.start()
    assert _wait_for(lambda: aborted)
    dog.stop()
    assert "collective #3 on world cannot finish: rank 2 has ended" in dog.fired[0]


def test_a_failing_probe_turns_the_listening_off_but_not_the_stall_watch():
    class Broken:
        def poll(self):
            raise RuntimeError("MPI_Iprobe failed")

    aborted = []
    dog = watchdog.Watchdog(0, aborted.append, 0.2)
    dog.listen(Broken(), lambda: 1)
    dog.start()
    with dog.watch("allreduce on world", lambda: "ranks 1"):
        assert _wait_for(lambda: aborted)
    dog.stop()
    assert dog.notices is None and "STALL on rank 0" in dog.fired[0]


def test_only_the_background_thread_stuck_and_nobody_waiting_is_not_reported():
    """A program that ends with an unsynchronized operation left on the background thread
    (Horovod gives that handle an error nobody reads): nothing the program waits for."""
    started = [5]
    blocked = [False]
    aborted = []
    dog = watchdog.Watchdog(0, aborted.append, 60.0)
    notices = FakeNotices()
    dog.listen(notices, lambda: started[0], lambda: blocked[0])
    notices.ended[1] = 4
    dog.start()
    time.sleep(finished.GRACE_SECONDS + 1.5)
    assert aborted == []
    blocked[0] = True  # now a caller waits for that operation
    assert _wait_for(lambda: aborted)
    dog.stop()


def test_the_background_thread_counts_as_blocking_only_while_someone_waits_for_it():
    import threading

    from hpctrain.comm import asyncq

    release = threading.Event()
    handle = asyncq.submit("held by the test", release.wait)
    try:
        assert not asyncq.foreground_blocked()  # stuck in the background, nobody waiting
        waiter = threading.Thread(target=handle.wait)
        waiter.start()
        assert _wait_for(asyncq.foreground_blocked)
    finally:
        release.set()
    waiter.join(10)
    asyncq.drain()
    assert asyncq.foreground_blocked()  # idle: a stuck collective would be a caller's own
