"""`hpctrain launch` ends an mpiexec that reported a rank's MPI_Abort and then stayed."""
import os
import subprocess
import sys
import time

import pytest

from hpctrain.cli import launch

OMPI5 = """--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 2 in communicator MPI_COMM_WORLD
  Proc: [[32260,1],2]
  Errorcode: 3

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
"""
OMPI4 = """--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD
with errorcode 7.

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
"""
MPICH = "application called MPI_Abort(MPI_COMM_WORLD, 9) - process 4\n"


@pytest.mark.parametrize("text,rank,code", [(OMPI5, 2, 3), (OMPI4, 1, 7), (MPICH, 4, 9)])
def test_each_launchers_abort_report_is_read(text, rank, code):
    report = launch.AbortReport(grace=5, clock=lambda: 0.0)
    report.feed("rank output before the abort\n")
    assert report.since is None
    report.feed(text)
    assert (report.rank, report.code, report.since) == (rank, code, 0.0)
    assert report.exit_status() == code


def test_a_report_split_across_reads_is_read_and_the_grace_counts_from_its_end():
    now = [10.0]
    report = launch.AbortReport(grace=5, clock=lambda: now[0])
    head, rest = OMPI5[:120], OMPI5[120:]
    report.feed(head)
    assert report.since is None  # the code has not come yet
    now[0] = 12.0
    report.feed(rest)
    assert report.since == 12.0
    now[0] = 16.9
    assert report() is None
    now[0] = 17.0
    assert "rank 2 called MPI_Abort (error code 3)" in report()
    report.feed(OMPI4)  # a second rank's report changes nothing
    assert (report.rank, report.since) == (2, 12.0)


def test_no_report_or_a_zero_grace_never_ends_the_job_and_code_zero_exits_one():
    now = [0.0]
    quiet, never = launch.AbortReport(grace=1, clock=lambda: now[0]), launch.AbortReport(grace=0, clock=lambda: now[0])
    quiet.feed("MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\n")  # no code yet
    never.feed(MPICH)
    now[0] = 1000.0
    assert quiet() is None and never() is None
    zero = launch.AbortReport(grace=1)
    zero.feed("application called MPI_Abort(MPI_COMM_WORLD, 256) - process 0\n")
    assert zero.exit_status() == 1


# An mpiexec that prints the abort report, then neither ends its child nor exits.
LINGERING = """#!/bin/sh
printf 'rank 0 says: \\303\\251t\\303\\251\\n' >&2
printf -- '--------\\nMPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\\n  Proc: [[1,1],1]\\n  Errorcode: 5\\n' >&2
date +%s.%N > "$REPORTED"
sleep 300 &
echo $! > "$PIDFILE"
wait
"""
# One that prints the same and exits as Open MPI does.
EXITING = """#!/bin/sh
printf 'MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\\n  Errorcode: 5\\n' >&2
exit 5
"""


def _launch(tmp_path, script, grace):
    exe = tmp_path / "mpiexec"
    exe.write_text(script)
    exe.chmod(0o755)
    env = {**os.environ, "HPCTRAIN_LAUNCH_ABORT_GRACE": str(grace), "PIDFILE": str(tmp_path / "pid"),
           "REPORTED": str(tmp_path / "reported"), "HPCTRAIN_MPIEXEC": str(exe)}
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "hpctrain.cli.main", "launch", "-n", "2", "--", "true"],
                          capture_output=True, timeout=120, env=env)
    return proc, time.time() - started


def test_a_launch_ends_an_mpiexec_that_stays_after_reporting_an_abort(tmp_path):
    import psutil

    proc, _ = _launch(tmp_path, LINGERING, grace=1.5)
    ended = time.time()
    err = proc.stderr.decode()
    assert proc.returncode == 5, err
    assert "rank 0 says: été\n" in err, "mpiexec's standard error must pass through unchanged"
    assert "mpiexec still runs 1.5 s later; ending it" in err, err
    waited = ended - float((tmp_path / "reported").read_text())
    assert waited >= 1.5, f"ended {waited:.2f} s after the report, before the 1.5 s grace"
    child = int((tmp_path / "pid").read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_an_mpiexec_that_exits_after_an_abort_keeps_its_status_and_is_not_waited_for(tmp_path):
    proc, took = _launch(tmp_path, EXITING, grace=60)
    assert proc.returncode == 5, proc.stderr.decode()
    assert "ending it" not in proc.stderr.decode()
    assert took < 30, f"hpctrain launch took {took:.1f} s after mpiexec exited"


# A launcher for --exact: records its arguments and environment, says when it got SIGUSR1.
RECORDING = """#!/bin/bash
printf '%s\\0' "$@" > "$ARGV"
env > "$ENVFILE"
trap 'echo usr1 > "$GOT"; exit 0' USR1
[ "$1" = "--wait" ] && { touch "$READY"; while :; do sleep 0.1; done; }
exit 3
"""


def _exact(tmp_path, script, *args, grace=60, signal_after=None):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "sitempirun"
    exe.write_text(script)
    exe.chmod(0o755)
    files = {name: str(tmp_path / name) for name in ("ARGV", "ENVFILE", "GOT", "READY", "PIDFILE", "REPORTED")}
    env = {**os.environ, **files, "HPCTRAIN_LAUNCH_ABORT_GRACE": str(grace),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("OMPI_MCA_osc", None)
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain.cli.main", "launch", "--exact", "--", "sitempirun", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    if signal_after:
        deadline = time.time() + 60
        while not os.path.exists(files["READY"]) and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal_after)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err.decode(), files


def test_exact_runs_the_launcher_line_as_given(tmp_path):
    rc, err, files = _exact(tmp_path, RECORDING, "-n", "4", "--map-by", "ppr:2:node", "python", "train.py", "--")
    assert rc == 3, err  # the launcher's own status
    with open(files["ARGV"], "rb") as fh:
        assert fh.read().split(b"\0")[:-1] == [b"-n", b"4", b"--map-by", b"ppr:2:node", b"python", b"train.py", b"--"]
    with open(files["ENVFILE"]) as fh:
        env = fh.read()
    assert "OMPI_MCA_osc=" not in env and "--oversubscribe" not in open(files["ARGV"]).read()


def test_exact_sends_signals_to_the_launcher_and_keeps_its_status(tmp_path):
    import signal

    rc, err, files = _exact(tmp_path, RECORDING, "--wait", signal_after=signal.SIGUSR1)
    assert os.path.exists(files["GOT"]), f"SIGUSR1 did not reach the launcher\n{err}"
    assert rc == 0, err  # the launcher exited 0 after the signal: not 128 + 10


def test_exact_ends_a_launcher_that_stays_after_an_abort(tmp_path):
    rc, err, _ = _exact(tmp_path, LINGERING, grace=1.5)
    assert rc == 5 and "ending it" in err, err


@pytest.mark.parametrize("args,says", [(["--exact", "--elastic", "--", "true"], "leave out -n, --elastic"),
                                       (["-n", "4", "--exact", "--", "true"], "leave out -n"),
                                       (["--exact", "--", "no-such-launcher-here", "-n", "2"], "not a program on PATH")])
def test_exact_refuses_what_it_cannot_do(args, says):
    proc = subprocess.run([sys.executable, "-m", "hpctrain.cli.main", "launch", *args], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and says in proc.stderr, proc.stderr


def test_exact_inside_slurm_leaves_sigterm_to_the_launcher(tmp_path, monkeypatch):
    """SLURM sends SIGTERM to every process of the step, mpirun too: --exact then survives it
    without passing a second one on (Open MPI's launcher aborts at once on a second)."""
    import signal

    script = RECORDING.replace("trap 'echo usr1 > \"$GOT\"; exit 0' USR1",
                               "trap 'echo term >> \"$GOT\"' TERM; trap 'echo usr1 >> \"$GOT\"; exit 0' USR1")
    assert "echo term" in script
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "sitempirun"
    exe.write_text(script)
    exe.chmod(0o755)
    got, ready = tmp_path / "got", tmp_path / "ready"
    env = {**os.environ, "ARGV": str(tmp_path / "argv"), "ENVFILE": str(tmp_path / "env"), "GOT": str(got),
           "READY": str(ready), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain.cli.main", "launch", "--exact", "--", "sitempirun", "--wait"],
                            stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 60
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None, "hpctrain launch --exact died of a SIGTERM meant for the step"
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert got.read_text().split() == ["usr1"], err.decode()  # no SIGTERM passed on; SIGUSR1 was
    assert proc.returncode == 0, err.decode()
