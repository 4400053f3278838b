"""The pure parts of elastic mode: whether a job can survive a lost rank, which errors are a
lost peer, the launcher's flags and verdict, and Horovod's elastic state and sampler."""
import pytest

from hpctrain.cli import launch
from hpctrain.comm import faults
from hpctrain.comm.errors import CommError, RanksLostError


def test_support_needs_the_extension_and_open_mpi_started_with_it():
    assert faults.support({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_MCA_mpi_ft_enable": "1"}, True) == (True, "")
    ok, why = faults.support({"OMPI_COMM_WORLD_SIZE": "3"}, True)
    assert not ok and "--with-ft ulfm" in why
    ok, why = faults.support({"OMPI_MCA_mpi_ft_enable": "1"}, False)
    assert not ok and "Shrink" in why
    ok, why = faults.support({"PMI_RANK": "0"}, True)
    assert not ok and "Open MPI" in why


def test_a_lost_peer_is_recognised_through_the_exception_chain():
    assert faults.is_failure(RanksLostError("x"))
    try:
        try:
            raise RanksLostError("peer died")
        except RanksLostError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert faults.is_failure(outer)
    assert not faults.is_failure(CommError("mismatch"))
    assert not faults.is_failure(ValueError("x"))
    assert not faults.is_failure(None)


def test_only_mpi_errors_of_the_failure_classes_translate():
    from mpi4py import MPI

    assert faults.translate(ValueError("x")) is None
    assert faults.translate(MPI.Exception(MPI.ERR_TRUNCATE)) is None
    assert faults.translate(MPI.Exception(MPI.ERR_IN_STATUS)) is None  # no failed process known here
    failed = MPI.Exception(75)
    if failed.Get_error_class() != 75:  # an MPI whose error codes differ: nothing to check here
        pytest.skip(f"this MPI maps error 75 to class {failed.Get_error_class()}")
    lost = faults.translate(failed)
    assert isinstance(lost, RanksLostError) and "a peer rank failed" in str(lost)


@pytest.mark.parametrize("text,flags", [
    ("mpiexec (Open MPI) 5.0.11\n", ["--with-ft", "ulfm"]),
    ("prterun (Open MPI) 5.0.3\n", ["--with-ft", "ulfm"]),
])
def test_elastic_flags_for_open_mpi_5(text, flags):
    assert launch.elastic_flags(text) == flags


@pytest.mark.parametrize("text,needle", [
    ("mpiexec (OpenRTE) 4.1.5\n", "Open MPI 5"),
    ("HYDRA build details:\n    Version: 4.1.2\n", "only Open MPI 5"),
])
def test_elastic_flags_refuse_other_launchers(text, needle):
    with pytest.raises(SystemExit, match=needle):
        launch.elastic_flags(text)


def test_outcome_counts_every_rank_as_finished_or_lost():
    reforms = [dict(old_size=4, new_size=3, lost=[3], lost_launched=[3], seconds=0.01, resumed_from={"step": 3}),
               dict(old_size=3, new_size=2, lost=[1], lost_launched=[1], seconds=0.02, resumed_from={"step": 9})]
    reports = [{"launched_rank": 0, "finished": True, "reforms": reforms},
               {"launched_rank": 2, "finished": True, "reforms": reforms}]
    outcome = launch.elastic_outcome(4, reports)
    assert outcome.finished and outcome.lost == [1, 3]
    text = outcome.summary()
    assert "2 of 4 rank(s) lost" in text and "4 -> 3 ranks, resumed from step=3" in text
    assert "lost launched rank(s) 1: 3 -> 2 ranks, resumed from step=9" in text
    # a survivor that did not report (crashed, or still running when mpiexec ended), or that
    # exited with an error: not finished
    assert not launch.elastic_outcome(4, reports[:1]).finished
    failed = [reports[0], {**reports[1], "exit_code": 2}]
    assert not launch.elastic_outcome(4, failed).finished
    assert launch.elastic_outcome(4, failed).failed == [2] and outcome.failed == []
    # ranks that aborted on an error (below min_ranks) report finished=False
    aborted = [{**r, "finished": False, "exit_code": 1} for r in reports]
    assert launch.elastic_outcome(4, aborted).failed == [0, 2] and not launch.elastic_outcome(4, aborted).finished
    assert not launch.elastic_outcome(2, []).finished


@pytest.mark.parametrize("rc,finished,want", [
    (0, [True, True, True], 0),      # everyone finished
    (0, [False, False, None], 1),    # two ranks aborted on an error, one lost; mpiexec said 0
    (1, [True, True, None], 0),      # one rank lost: mpiexec reports that as a failure
    (1, [True, False, None], 1),     # a survivor failed
    (137, [True, True, None], 137),  # the launch itself was killed
])
def test_elastic_launch_exit_status_follows_the_reports(monkeypatch, capsys, rc, finished, want):
    """What `hpctrain launch --elastic` exits with, from mpiexec's status and the reports."""
    import argparse
    import json
    import os

    def fake_run(argv, env, overdue=None):
        folder = env["HPCTRAIN_ELASTIC_REPORT"]
        lost = [r for r, f in enumerate(finished) if f is None]
        reforms = [dict(old_size=3, new_size=3 - len(lost), lost_launched=lost)] if lost else []
        for r, f in enumerate(finished):
            if f is not None:
                report = {"launched_rank": r, "finished": f, "exit_code": 0 if f else 1, "reforms": reforms}
                with open(os.path.join(folder, f"rank-{r}.json"), "w") as out:
                    json.dump(report, out)
        return rc

    monkeypatch.setattr(launch, "run_forwarding_signals", fake_run)
    monkeypatch.setattr(launch, "version_text", lambda exe: "mpiexec (Open MPI) 5.0.11\n")
    args = argparse.Namespace(np=3, min_np=2)
    assert launch.run_elastic("mpiexec", args, [], ["python", "x.py"], {}) == want
    if want == 1 and rc == 0:
        assert "ended with an error" in capsys.readouterr().err


FAKE_MPIEXEC = """#!/bin/sh
# an mpiexec that takes a rank's abort and then neither ends its processes nor exits
printf '{"launched_rank": 1, "finished": false, "exit_code": 1, "reforms": []}' > "$HPCTRAIN_ELASTIC_REPORT/rank-1.json"
date +%s.%N > "$REPORTED"
sleep 300 &
echo $! > "$PIDFILE"
wait
"""


def test_a_launch_whose_mpiexec_outlives_an_abort_ends_it_after_the_grace(tmp_path, monkeypatch, capsys):
    import argparse
    import os
    import time

    import psutil

    exe = tmp_path / "mpiexec"
    exe.write_text(FAKE_MPIEXEC)
    exe.chmod(0o755)
    monkeypatch.setattr(launch, "version_text", lambda exe: "mpiexec (Open MPI) 5.0.11\n")
    monkeypatch.setattr(launch, "ABORT_GRACE_S", 1.5)
    pidfile, reported = tmp_path / "pid", tmp_path / "reported"
    env = {"PATH": os.environ["PATH"], "PIDFILE": str(pidfile), "REPORTED": str(reported)}
    rc = launch.run_elastic(str(exe), argparse.Namespace(np=3, min_np=2), [], ["python", "x.py"], env)
    ended = time.time()
    assert rc == 1
    waited = ended - float(reported.read_text())
    assert waited >= 1.5, f"mpiexec was stopped {waited:.2f} s after the abort report, before the 1.5 s grace"
    err = capsys.readouterr().err
    assert "launched rank(s) 1 aborted the job on an error, but mpiexec has not ended it 2 s later" in err, err
    child = int(pidfile.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_the_abort_deadline_starts_at_the_first_failed_report(tmp_path):
    import json

    now = [100.0]
    deadline = launch.AbortDeadline(str(tmp_path), grace=10, clock=lambda: now[0])
    (tmp_path / "rank-0.json").write_text(json.dumps({"launched_rank": 0, "finished": True, "exit_code": 0}))
    assert deadline() is None
    now[0] = 500.0  # a finished rank starts no deadline
    assert deadline() is None
    (tmp_path / "rank-2.json").write_text(json.dumps({"launched_rank": 2, "finished": False, "exit_code": 1}))
    assert deadline() is None  # seen now: the grace starts
    now[0] = 509.9
    assert deadline() is None
    now[0] = 510.0
    assert "launched rank(s) 2 aborted the job" in deadline()


def test_a_rank_whose_mpi_abort_never_returns_exits_after_the_deadline(tmp_path):
    """MPI_Abort that blocks (as under fault tolerance, once): the rank ends itself."""
    import subprocess
    import sys
    import time

    code = (
        "import sys, time\n"
        "import hpctrain.comm\n"
        "world = sys.modules['hpctrain.comm.world']  # the package's `world` is the function\n"
        "class Comm:\n"
        "    def Abort(self, code):\n"
        "        time.sleep(300)\n"
        "class MPI:\n"
        "    COMM_WORLD = Comm()\n"
        "world._state['MPI'] = MPI\n"
        "world.ABORT_DEADLINE_S = 1.0\n"
        "world.abort_job(3)\n"
    )
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert time.monotonic() - start < 30
    assert "Timeout" in out.stderr and "Abort" in out.stderr, out.stderr


def test_object_state_commits_restores_and_syncs():
    from hpctrain.torch.elastic import ObjectState

    sent = []

    def bcast(obj):
        sent.append(obj)
        return {"epoch": 7, "batch": 0}  # what rank 0 holds

    state = ObjectState(bcast_object=bcast, get_rank=lambda: 1, epoch=1, batch=5)
    state.batch = 9
    state.restore()
    assert (state.epoch, state.batch) == (1, 5)
    state.batch = 12
    state.save()
    state.batch = 13
    state.restore()
    assert state.batch == 12
    state.sync()
    assert (state.epoch, state.batch) == (7, 0) and sent == [{"epoch": 1, "batch": 12}]


def test_reset_callbacks_run_after_a_reset():
    from hpctrain.torch.elastic import ObjectState

    calls = []
    state = ObjectState(bcast_object=lambda o: o, get_rank=lambda: 0, step=0)
    state.register_reset_callbacks([lambda: calls.append("a"), lambda: calls.append("b")])
    state.on_reset()
    assert calls == ["a", "b"]


def test_host_updates_interrupt_every_rank_alike():
    from hpctrain.torch.elastic import HostsUpdatedInterrupt, ObjectState

    state = ObjectState(bcast_object=lambda o: o, get_rank=lambda: 0, step=0)
    state.check_host_updates()  # nothing recorded
    state.on_hosts_updated(5, removed_only=True)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync is True
    state.check_host_updates()  # consumed


def test_elastic_sampler_repartitions_the_rest_of_the_epoch(monkeypatch):
    from hpctrain import comm
    from hpctrain.torch.elastic import ElasticSampler

    world = {"size": 3, "rank": 0}
    monkeypatch.setattr(comm, "is_initialized", lambda: True)
    monkeypatch.setattr(comm, "size", lambda: world["size"])
    monkeypatch.setattr(comm, "rank", lambda: world["rank"])
    data = list(range(20))

    def shares():
        out = []
        for r in range(world["size"]):
            world["rank"] = r
            s = ElasticSampler(data, shuffle=True, seed=4)
            s.load_state_dict(state)
            out.append(list(s))
        return out

    state = {"epoch": 2, "processed_num": 0}
    full = shares()
    assert set().union(*map(set, full)) == set(data) and all(len(share) == 7 for share in full)  # 21: one padded
    order = [i for batch in zip(*full) for i in batch]  # the shuffled order, rank-interleaved
    state = {"epoch": 2, "processed_num": 6}  # two batches of 1 on 3 ranks
    world["size"] = 2
    rest = shares()
    assert sorted(rest[0] + rest[1]) == sorted(order[6:20])
    assert len(rest[0]) == len(rest[1]) == 7


def test_the_report_names_each_loss_of_ranks():
    from hpctrain.train.report import render_summary, summarize

    def step(s, ranks):
        fields = ("step_time", "data_wait", "forward", "backward", "comm", "optimizer")
        return {"kind": "train", "step": s, "loss": 1.0 / s, "step_time": 0.01,
                **{"rank_" + f: [0.002] * ranks for f in fields}}

    records = [step(s, 3) for s in range(1, 13)]
    records.append({"kind": "event", "what": "ranks_lost", "step": 13, "lost": [1], "ranks_before": 3, "ranks": 2,
                    "resumed_step": 12})
    records += [step(s, 2) for s in range(13, 31)]
    s = summarize(records)
    assert s["ranks"] == 2 and len(s["ranks_lost"]) == 1
    assert "lost rank(s) 1 in step 13: 3 -> 2 ranks, resumed from step 12" in render_summary(s, "run")


def test_config_elastic_section():
    from hpctrain.train.config import ConfigError, config_from_dict

    base = {"data": {"train": ["x.h5"]}, "steps": 5}
    assert config_from_dict({**base, "elastic": {"min_ranks": 2}}).elastic.min_ranks == 2
    assert config_from_dict(base).elastic.min_ranks == 0
    with pytest.raises(ConfigError, match="min_ranks"):
        config_from_dict({**base, "elastic": {"min_ranks": -1}})
    with pytest.raises(ConfigError, match="pipeline"):
        config_from_dict({**base, "elastic": {"min_ranks": 2}, "parallel": {"pipeline_stages": 2}})


def test_a_non_elastic_job_refuses_an_elastic_config(monkeypatch):
    from hpctrain.train import elastic
    from hpctrain.train.config import ConfigError, config_from_dict

    monkeypatch.setenv("HPCTRAIN_ELASTIC", "0")
    from hpctrain import settings

    settings.reset()
    cfg = config_from_dict({"data": {"train": ["x.h5"]}, "steps": 5, "elastic": {"min_ranks": 2}})
    with pytest.raises(ConfigError, match="--elastic"):
        elastic.check_job(cfg)
    settings.reset()


def test_sbatch_templates_render_elastic_jobs_with_mpirun_only():
    from hpctrain.slurm.render import make_spec, render

    spec = make_spec("cpu-mpi", ["python", "train.py"], launcher="mpirun", tasks_per_node=3, elastic_min_ranks=2)
    text = render("cpu-mpi", spec)
    assert 'launch=(hpctrain launch --elastic -n "${SLURM_NTASKS}" --min-np 2 --)' in text
    assert "--with-ft" not in render("cpu-mpi", make_spec("cpu-mpi", ["python", "t.py"], launcher="mpirun"))
    with pytest.raises(ValueError, match="cancels the whole job step"):
        make_spec("cpu-mpi", ["python", "t.py"], launcher="srun", elastic_min_ranks=2)
    with pytest.raises(ValueError, match="between 1 and the job's 2 tasks"):
        make_spec("cpu-mpi", ["python", "t.py"], launcher="mpirun", elastic_min_ranks=3)


@pytest.mark.parametrize("code,status", [(0, 0), (3, 3), (257, 1), ("bad input", 1), (True, 1)])
def test_exit_code_as_python_computes_it(code, status):
    assert faults.exit_code(code) == status


def test_exit_code_without_sys_exit_is_zero():
    assert faults.exit_code() == 0


def _stall_with_hook(monkeypatch, hook, what: str, missing: str) -> list:
    """One wait of 0.8 s under a 0.1 s watchdog whose elastic hook is ``hook``; the abort codes."""
    import time

    from hpctrain.comm import watchdog

    aborted = []
    monkeypatch.setitem(watchdog.ON_STALL, "fn", hook)
    dog = watchdog.Watchdog(0, aborted.append, 0.1)
    dog.start()
    with dog.watch(what, lambda: missing):
        time.sleep(0.8)
    dog.stop()
    return aborted


def test_the_watchdog_asks_the_elastic_hook_before_aborting(monkeypatch):
    asked = []

    def hook(what, waited, missing):  # a lost rank the first time, a plain stall the second
        asked.append((what, missing()))
        return len(asked) == 1

    aborted = _stall_with_hook(monkeypatch, hook, "recv_object from rank 1", "rank 1")
    assert asked[:2] == [("recv_object from rank 1", "rank 1")] * 2 and aborted == [3]


def test_a_wait_the_revoke_did_not_end_aborts_at_its_next_stall(monkeypatch):
    """The hook says "a lost rank" every time, but the wait goes on: the second stall of the
    same wait aborts instead of revoking again for ever."""
    asked = []

    def hook(what, waited, missing):
        asked.append(what)
        return True

    aborted = _stall_with_hook(monkeypatch, hook, "allreduce on world", "rank 2")
    assert len(asked) == 2 and aborted == [3]
