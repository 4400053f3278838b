"""hpctrain.slurm.jobs: job ids, squeue/scontrol/sacct output -> rows, log file locations.

The squeue and scontrol files in tests/golden/slurm_jobs were captured from Slurm 22.05
(slurm/local-cluster.sh); the sacct files are in ``sacct --parsable2`` format with the
fields of ``SACCT_FIELDS`` (the local cluster keeps no accounting, so sacct cannot run there).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.slurm.jobs import (SACCT_FIELDS, JobRef, JobRow, accounting_disabled, expand_pattern,
                                 format_rows, log_candidates, parse_job_ref, parse_sacct,
                                 parse_scontrol_records, parse_squeue, row_from_scontrol, squeue_format)

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "slurm_jobs"


def golden(name: str) -> str:
    return (GOLDEN / name).read_text()


@pytest.mark.parametrize("text, job, task, step, arg", [
    ("123", 123, None, None, "123"),
    ("123_4", 123, 4, None, "123_4"),
    ("123.0", 123, None, "0", "123"),
    ("123.batch", 123, None, "batch", "123"),
    ("123_4.extern", 123, 4, "extern", "123_4"),
    (" 77 ", 77, None, None, "77"),
])
def test_job_ref(text, job, task, step, arg):
    ref = parse_job_ref(text)
    assert (ref.job, ref.task, ref.step, ref.job_arg) == (job, task, step, arg)
    assert str(ref) == text.strip()


@pytest.mark.parametrize("text", ["", "abc", "12x", "123_", "123.", "123_4_5", "-1", "123 456", "123.foo"])
def test_job_ref_rejects(text):
    with pytest.raises(ValueError, match="not a SLURM job id.*\nHINT"):
        parse_job_ref(text)


def test_squeue_rows():
    assert squeue_format() == "%i|%j|%T|%M|%l|%R|%u"
    rows = parse_squeue(golden("squeue.txt"))
    assert [r.job_id for r in rows] == ["5", "1", "2_0", "2_1", "2_2"]
    pending, running = rows[0], rows[1]
    assert (pending.state, pending.reason, pending.nodes, pending.time_limit) == ("PENDING", "BeginTime", "", "UNLIMITED")
    # a '|' inside the job name stays in the name
    assert (running.name, running.state, running.nodes, running.user) == ("cap|ture", "RUNNING", "vm", "root")
    assert all(r.source == "squeue" and not r.ended for r in rows)


def test_squeue_rejects_foreign_format():
    with pytest.raises(ValueError, match="unexpected squeue line"):
        parse_squeue("JOBID PARTITION NAME\n")


def test_scontrol_running_keeps_paths_with_odd_characters():
    (rec,) = parse_scontrol_records(golden("scontrol-running.txt"))
    row = row_from_scontrol(rec)
    assert (row.job_id, row.name, row.state, row.reason) == ("1", "cap|ture", "RUNNING", "")
    assert row.stdout == "/tmp/vj/cap|ture-1.out" and row.stderr == "/tmp/vj/cap|ture-1.err"
    assert (row.work_dir, row.nodes, row.user, row.time_limit) == ("/tmp/vj", "vm", "root", "00:02:00")


def test_scontrol_array_gives_one_row_per_task():
    rows = [row_from_scontrol(r) for r in parse_scontrol_records(golden("scontrol-array.txt"))]
    assert sorted(r.job_id for r in rows) == ["2_0", "2_1", "2_2"]
    by_id = {r.job_id: r for r in rows}
    assert by_id["2_2"].stdout == "/tmp/vj/arr-2_2.out"
    assert by_id["2_0"].stdout == "/tmp/vj/arr-2_0.out"


def test_scontrol_pending_and_cancelled():
    pending = row_from_scontrol(parse_scontrol_records(golden("scontrol-pending.txt"))[0])
    assert (pending.state, pending.reason, pending.nodes, pending.ended) == ("PENDING", "BeginTime", "", False)
    assert pending.stdout == "/tmp/vj/slurm-5.out" == pending.stderr
    cancelled = row_from_scontrol(parse_scontrol_records(golden("scontrol-cancelled.txt"))[0])
    assert (cancelled.state, cancelled.ended) == ("CANCELLED", True)


def test_scontrol_one_line_records():
    text = ("JobId=7 JobName=a JobState=COMPLETED StdOut=/x/a-7.out WorkDir=/x\n"
            "JobId=8 JobName=b JobState=FAILED StdOut=/x/b-8.out WorkDir=/x\n")
    rows = [row_from_scontrol(r) for r in parse_scontrol_records(text)]
    assert [(r.job_id, r.state, r.stdout) for r in rows] == [("7", "COMPLETED", "/x/a-7.out"),
                                                              ("8", "FAILED", "/x/b-8.out")]


def test_sacct_rows_and_steps_inherit_workdir():
    rows = parse_sacct(golden("sacct.txt"))
    assert [r.job_id for r in rows] == ["4242", "4242.batch", "4242.extern", "4242.0"]
    job = rows[0]
    assert (job.state, job.name, job.work_dir, job.user, job.ended, job.is_step) == \
        ("CANCELLED", "train", "/home/ana/proj", "ana", True, False)
    step = rows[3]
    assert (step.state, step.exit_code, step.work_dir, step.is_step) == ("CANCELLED", "0:15", "/home/ana/proj", True)


def test_sacct_array_and_header_checks():
    rows = parse_sacct(golden("sacct-array.txt"))
    assert [(r.job_id, r.state) for r in rows if not r.is_step] == [("4300_0", "COMPLETED"), ("4300_1", "FAILED")]
    assert golden("sacct.txt").splitlines()[0].split("|") == list(SACCT_FIELDS)
    assert parse_sacct("") == []
    with pytest.raises(ValueError, match="unexpected sacct header"):
        parse_sacct("       JobID    JobName      State\n------------ ---------- ----------\n")
    with pytest.raises(ValueError, match="unexpected sacct line"):
        parse_sacct("JobID|State\n1|RUNNING|extra\n")


def test_accounting_disabled():
    assert accounting_disabled("Slurm accounting storage is disabled\n")  # Slurm 22.05, captured
    assert not accounting_disabled("sacct: error: Invalid field requested: \"Foo\"\n")


@pytest.mark.parametrize("pattern, expected", [
    ("%x-%j.out", "train-42.out"),
    ("slurm-%A_%a.out", "slurm-42_4294967294.out"),
    ("%u/%4j-%%.log", "ana/0042-%.log"),
    ("out-%N.txt", "out-node1.txt"),
])
def test_expand_pattern(pattern, expected):
    assert expand_pattern(pattern, job_id=42, name="train", user="ana", node="node1") == expected


def test_expand_pattern_array_task():
    assert expand_pattern("%x-%A_%3a.out", job_id=4302, name="shard", array_job=4300, task=1) == "shard-4300_001.out"


def test_log_candidates_exact_from_scontrol():
    row = JobRow(job_id="1", stdout="/w/a-1.out", stderr="/w/a-1.err", work_dir="/w")
    assert log_candidates(row, "out") == ["/w/a-1.out"]
    assert log_candidates(row, "err") == ["/w/a-1.err"]


def test_log_candidates_from_sacct_follow_the_templates():
    job, array_task = parse_sacct(golden("sacct.txt"))[0], parse_sacct(golden("sacct-array.txt"))[2]
    out = log_candidates(job, "out")
    assert out[0] == "/home/ana/proj/train-4242.out"  # the templates' default %x-%j.out
    assert "/home/ana/proj/runs/train/slurm-4242.out" in out  # hpctrain slurm submit's run directory
    assert "/home/ana/proj/slurm-4242.out" in out  # sbatch's default
    assert log_candidates(job, "err")[0] == "/home/ana/proj/train-4242.err"
    # an array task: the templates' %x-%A_%a.out
    assert "/scratch/ana/data/shard-4300_1.out" in log_candidates(array_task, "out")
    assert log_candidates(JobRow(job_id="9"), "out") == []


def test_log_patterns_cover_the_template_defaults():
    from hpctrain.slurm.render import TEMPLATES, JobSpec

    spec = JobSpec(command=("x",))
    from hpctrain.slurm.jobs import OUTPUT_PATTERNS

    assert spec.output in OUTPUT_PATTERNS["out"] and spec.error in OUTPUT_PATTERNS["err"]
    for info in TEMPLATES.values():
        for key, stream in (("output", "out"), ("error", "err")):
            if key in info.defaults:
                assert info.defaults[key] in OUTPUT_PATTERNS[stream], (info.name, info.defaults[key])


def test_format_rows():
    text = format_rows([JobRow(job_id="5", name="later", state="PENDING", reason="BeginTime"),
                        JobRow(job_id="1", name="x", state="RUNNING", nodes="vm", elapsed="0:07")])
    lines = text.splitlines()
    assert lines[0].split() == ["JOBID", "NAME", "STATE", "TIME", "LIMIT", "NODES/REASON", "EXIT"]
    assert "(BeginTime)" in lines[1] and lines[2].split() == ["1", "x", "RUNNING", "0:07", "vm"]
    assert isinstance(parse_job_ref("5"), JobRef)
