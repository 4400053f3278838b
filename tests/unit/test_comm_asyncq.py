"""The background queue's fusion, without MPI: a stand-in negotiation plays the other ranks."""
import threading

import pytest

from hpctrain.comm import asyncq


def _queue_behind_gate(worker, jobs):
    gate = threading.Event()
    worker.submit("gate", gate.wait)
    handles = [worker.submit(name, fn, fuse) for name, fn, fuse in jobs]
    return gate, handles


def _fusable(key, nbytes, item, ran, others_hold=None):
    def negotiate(count):
        return count if others_hold is None else max(1, min(count, others_hold))

    def run_many(items):
        ran.append(list(items))
        return [f"fused:{i}" for i in items]

    return asyncq.Fusable(key, nbytes, item, run_many, negotiate)


def test_consecutive_jobs_of_one_key_fuse_up_to_the_threshold(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "30")
    worker, ran = asyncq._Worker(), []
    jobs = [(f"j{i}", lambda i=i: f"alone:{i}", _fusable("f32", 10, i, ran)) for i in range(5)]
    jobs.append(("other", lambda: "alone:other", _fusable("f64", 10, "other", ran)))
    jobs.append(("plain", lambda: "alone:plain", None))
    gate, handles = _queue_behind_gate(worker, jobs)
    gate.set()
    results = [h.wait(10) for h in handles]
    assert ran == [[0, 1, 2], [3, 4]]  # 3 × 10 bytes fit in 30; the f64 job has another key
    assert results == ["fused:0", "fused:1", "fused:2", "fused:3", "fused:4", "alone:other", "alone:plain"]
    assert worker.fused_calls == 2


def test_the_agreed_count_bounds_the_batch():
    # Another rank holds only 2 queued calls: every rank fuses 2, then negotiates again.
    worker, ran = asyncq._Worker(), []
    jobs = [(f"j{i}", lambda i=i: f"alone:{i}", _fusable("k", 1, i, ran, others_hold=2)) for i in range(5)]
    gate, handles = _queue_behind_gate(worker, jobs)
    gate.set()
    assert [h.wait(10) for h in handles] == ["fused:0", "fused:1", "fused:2", "fused:3", "alone:4"]
    assert ran == [[0, 1], [2, 3]]


def test_a_failed_fused_collective_reaches_every_handle_and_the_queue_goes_on():
    worker = asyncq._Worker()

    def broken(items):
        raise RuntimeError("peer mismatch")

    fuse = [asyncq.Fusable("k", 1, i, broken, lambda c: c) for i in range(3)]
    gate, handles = _queue_behind_gate(worker, [(f"j{i}", lambda: None, f) for i, f in enumerate(fuse)])
    after = worker.submit("after", lambda: "ran")
    gate.set()
    for h in handles:
        with pytest.raises(RuntimeError, match="peer mismatch"):
            h.wait(10)
    assert after.wait(10) == "ran"
    worker.drain()  # every job counted done: drain returns


def test_threshold_from_the_environment(monkeypatch):
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    assert asyncq.fusion_threshold() == 128 * 1024 * 1024
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    assert asyncq.fusion_threshold() == 0
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "64MB")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD"):
        asyncq.fusion_threshold()


def test_a_blocking_call_runs_in_the_callers_thread_after_the_queued_jobs():
    """run_now (hvd.allreduce and the gradients' all-reduces): the async jobs queued before it
    finish first (the order every rank keeps), then it runs here, not on the background thread;
    its error is raised by wait(), as an async job's is."""
    order = []
    gate = threading.Event()
    queued = asyncq.submit("queued", lambda: (gate.wait(10), order.append("queued"))[1])
    threading.Timer(0.2, gate.set).start()
    here = threading.current_thread()
    done = asyncq.run_now("now", lambda: order.append(("now", threading.current_thread() is here)) or 7)
    assert order == ["queued", ("now", True)]
    assert queued.done() and done.done() and done.wait() == 7
    failed = asyncq.run_now("bad", lambda: 1 / 0)
    assert failed.done()
    with pytest.raises(ZeroDivisionError):
        failed.wait()
