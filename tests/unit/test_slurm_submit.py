"""hpctrain.slurm.submit: parsing sbatch's and scontrol's output (pure)."""
import pytest

from hpctrain.slurm.submit import SubmitError, parse_job_id, parse_scontrol_show_job


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
