"""`hpctrain slurm status | cancel | logs` as a user runs them: against the local SLURM
(slurm/local-cluster.sh) for a real job, and against stand-in tools on PATH for what the
local cluster cannot show (sacct with accounting, missing tools)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_fixture import ROOT, slurm_cluster  # noqa: F401 (fixture)

PY = sys.executable
HPCTRAIN = [PY, "-m", "hpctrain.cli.main", "slurm"]
GOLDEN = ROOT / "tests" / "golden" / "slurm_jobs"
TIMEOUT = 120


def slurm(*args: str, env=None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*HPCTRAIN, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)


def submit(run_dir: Path, *options: str, command) -> str:
    done = slurm("submit", "cpu-mpi", "--run-dir", str(run_dir), "--venv", sys.prefix, "--time", "5",
                 "--launcher", "none", *options, "--", *command)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def wait_for(predicate, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def row_state(status_stdout: str, job: str) -> str:
    for line in status_stdout.splitlines()[1:]:
        cells = line.split()
        if cells and cells[0] == job:
            return cells[2]
    return ""


@pytest.mark.usefixtures("slurm_cluster")
def test_status_logs_follow_cancel_a_running_job(tmp_path):
    script = "echo first-line; sleep 1; echo ready-marker; echo to-stderr >&2; sleep 120; echo never"
    job = submit(tmp_path / "run", "--job-name", "day2", command=["bash", "-c", script])
    try:
        def running():
            done = slurm("status", job)
            assert done.returncode == 0, done.stderr
            state = row_state(done.stdout, job)
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), done.stdout
            return state == "RUNNING"

        wait_for(running, f"job {job} to run")
        listing = slurm("status")
        assert listing.returncode == 0 and row_state(listing.stdout, job) == "RUNNING", listing

        def printed():
            done = slurm("logs", job)
            return done.returncode == 0 and "ready-marker" in done.stdout and done

        out = wait_for(printed, f"job {job}'s output")
        assert out.stdout.startswith("first-line\n"), out.stdout
        err = slurm("logs", job, "--err")
        assert err.returncode == 0, err.stderr
        assert "to-stderr" in err.stdout.splitlines() and "first-line" not in err.stdout.splitlines(), err.stdout

        follower = subprocess.Popen([*HPCTRAIN, "logs", job, "--follow"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=ROOT)
        time.sleep(1.0)
        assert follower.poll() is None, "logs --follow returned while the job runs"
        cancel = slurm("cancel", job)
        assert cancel.returncode == 0, cancel.stderr
        assert f"job {job}: CANCELLED" in cancel.stderr, cancel.stderr
        followed, _ = follower.communicate(timeout=30)  # ends by itself once the job has ended
        assert follower.returncode == 0 and "ready-marker" in followed.splitlines(), followed
        assert "never" not in followed.splitlines(), followed
    finally:
        subprocess.run(["scancel", job], timeout=30)
    after = slurm("status", job)
    assert after.returncode == 0 and row_state(after.stdout, job) == "CANCELLED", after.stdout
    again = slurm("cancel", job)
    assert again.returncode == 0 and "already ended (CANCELLED)" in again.stderr, again.stderr


@pytest.mark.usefixtures("slurm_cluster")
def test_pending_job_and_unknown_job(tmp_path):
    job = submit(tmp_path / "later", "--job-name", "later", "--sbatch-arg=--begin=now+600",
                 command=["echo", "hi"])
    try:
        status = slurm("status", job)
        assert status.returncode == 0 and row_state(status.stdout, job) == "PENDING", status.stdout
        assert "(BeginTime)" in status.stdout, status.stdout
        logs = slurm("logs", job)
        assert logs.returncode == 1 and "PENDING; no output yet" in logs.stderr and "HINT: add --follow" in logs.stderr
        assert str(tmp_path / "later" / f"slurm-{job}.out") in logs.stderr, logs.stderr
    finally:
        assert slurm("cancel", job).returncode == 0
    for verb in ("status", "cancel", "logs"):
        unknown = slurm(verb, "987654321")
        assert unknown.returncode == 2, unknown
        assert "job 987654321 is not known to SLURM" in unknown.stderr and "HINT:" in unknown.stderr, unknown.stderr


def fake_tools(tmp_path: Path, sacct_output: str) -> dict:
    """PATH with an scontrol that knows no job (slurmctld forgot it) and an sacct that does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "sacct.txt").write_text(sacct_output)
    tools = {"scontrol": "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1",
             "sacct": f"cat {tmp_path / 'sacct.txt'}", "squeue": "exit 0", "scancel": "exit 0"}
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}


def test_after_slurmctld_forgot_the_job_sacct_answers(tmp_path):
    work = tmp_path / "proj"
    (work / "runs" / "train").mkdir(parents=True)
    (work / "runs" / "train" / "slurm-4242.out").write_text("epoch 1 loss 0.5\n")
    text = (GOLDEN / "sacct.txt").read_text().replace("/home/ana/proj", str(work))
    env = fake_tools(tmp_path, text)
    status = slurm("status", "4242", env=env)
    assert status.returncode == 0, status.stderr
    assert row_state(status.stdout, "4242") == "CANCELLED" and "4242.batch" not in status.stdout
    steps = slurm("status", "4242", "--steps", env=env)
    assert "4242.batch" in steps.stdout and "4242.0" in steps.stdout
    logs = slurm("logs", "4242", env=env)
    assert logs.returncode == 0 and logs.stdout == "epoch 1 loss 0.5\n", logs
    err = slurm("logs", "4242", "--err", env=env)
    assert err.returncode == 2 and "no stderr file for job 4242 (CANCELLED)" in err.stderr, err.stderr
    assert str(work / "train-4242.err") in err.stderr and "HINT:" in err.stderr
    cancel = slurm("cancel", "4242", env=env)
    assert cancel.returncode == 0 and "already ended (CANCELLED)" in cancel.stderr, cancel.stderr


def test_array_job_logs_need_a_task(tmp_path):
    env = fake_tools(tmp_path, (GOLDEN / "sacct-array.txt").read_text())
    done = slurm("logs", "4300", env=env)
    assert done.returncode == 2 and "array of 2 tasks" in done.stderr and "hpctrain slurm logs 4300_1" in done.stderr


def test_missing_tools_and_bad_ids(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no SLURM tools at all
    for argv in (("status",), ("status", "12"), ("cancel", "12"), ("logs", "12")):
        done = slurm(*argv, env=env)
        assert done.returncode == 2, done
        lines = done.stderr.strip().splitlines()
        assert "not found on PATH" in lines[0] and lines[-1].startswith("HINT:"), done.stderr
    bad = slurm("status", "12x")
    assert bad.returncode == 2 and "'12x' is not a SLURM job id" in bad.stderr, bad.stderr
