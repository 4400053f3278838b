"""hpctrain.slurm.submit: parsing sbatch's and scontrol's output (pure), and how a wait decides a job has ended."""
import subprocess

import pytest

from hpctrain.slurm import submit
from hpctrain.slurm.submit import SubmitError, has_ended, parse_job_id, parse_scontrol_show_job


@pytest.mark.parametrize(
    "out,job", [("Submitted batch job 42\n", 42), ("1234\n", 1234), ("99;cluster2\n", 99),
                ("sbatch: warning: x\nSubmitted batch job 7", 7)],
)
def test_parse_job_id(out, job):
    assert parse_job_id(out) == job


def test_parse_job_id_error_quotes_output():
    with pytest.raises(SubmitError, match="sbatch: error: Batch job submission failed"):
        parse_job_id("sbatch: error: Batch job submission failed: Invalid account")


SHOW_JOB = """JobId=6 JobName=x; touch /tmp/owned
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   JobState=COMPLETED Reason=None Dependency=(null)
   Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0
   Command=/tmp/run dir/job.sbatch
   WorkDir=/tmp/run dir
   StdOut=/tmp/run dir/slurm-6.out
"""


def test_parse_scontrol_show_job():
    info = parse_scontrol_show_job(SHOW_JOB)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1" and info["ExitCode"] == "0:0"
    assert info["Command"] == "/tmp/run dir/job.sbatch" and info["WorkDir"] == "/tmp/run dir"
    assert info["JobName"] == "x; touch /tmp/owned"


@pytest.mark.parametrize("info, ended", [
    ({"JobState": "COMPLETED"}, True), ({"JobState": "FAILED"}, True), ({}, True),
    ({"JobState": "PENDING"}, False), ({"JobState": "REQUEUED"}, False),
    ({"JobState": "COMPLETING"}, False), ({"JobState": "RUNNING"}, False),
])
def test_has_ended(info, ended):
    assert has_ended(info) is ended


def test_wait_for_job_waits_through_a_requeue_and_squeue_errors(monkeypatch):
    """squeue stops listing a job being requeued, and fails now and then on a loaded
    slurmctld: neither ends the wait; only scontrol's final state does."""
    answers = [  # (squeue rc, squeue out, scontrol show job state)
        (0, "RUNNING", None),
        (0, "", "REQUEUED"),
        (1, "", "PENDING"),       # slurm_load_jobs error: Socket timed out
        (0, "PENDING", None),
        (0, "", "COMPLETED"),
    ]
    step = {"i": 0, "shows": 0}

    def run(argv, **kw):
        rc, out, state = answers[step["i"]]
        if "squeue" in argv[0]:
            return subprocess.CompletedProcess(argv, rc, out + "\n", "")
        step["shows"] += 1
        return subprocess.CompletedProcess(argv, 0, f"JobId=9 JobState={state} Restarts=1", "")

    def sleep(s):
        step["i"] += 1

    monkeypatch.setattr(submit, "_require", lambda tool: tool)
    monkeypatch.setattr(submit.subprocess, "run", run)
    monkeypatch.setattr(submit.time, "sleep", sleep)
    info = submit.wait_for_job(9, timeout=60, poll=0.01)
    assert info["JobState"] == "COMPLETED" and step["i"] == 4 and step["shows"] == 3
