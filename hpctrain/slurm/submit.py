"""Submit scripts with ``sbatch``, follow jobs with ``squeue``/``scontrol``/``sacct``, cancel
them with ``scancel``.

The only module of ``hpctrain.slurm`` that runs SLURM commands; the parsing it needs
(:func:`parse_job_id`, :func:`parse_scontrol_show_job`, :mod:`hpctrain.slurm.jobs`) is pure
and unit-tested.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from hpctrain.slurm.jobs import FINAL_STATES, JobRef, JobRow, key_values

__all__ = [
    "SubmitError",
    "parse_job_id",
    "parse_scontrol_show_job",
    "sbatch",
    "job_state",
    "job_info",
    "wait_for_job",
    "has_ended",
    "FINAL_STATES",
]

_SUBMITTED = re.compile(r"Submitted batch job (\d+)")
_PARSABLE = re.compile(r"^(\d+)(?:;\S+)?$")


class SubmitError(RuntimeError):
    """sbatch is missing or refused the script; the message carries its output."""


def parse_job_id(output: str) -> int:
    """The job id in sbatch's output: ``Submitted batch job 42`` or ``--parsable``'s ``42;cluster``."""
    m = _SUBMITTED.search(output)
    if m:
        return int(m.group(1))
    for line in output.splitlines():
        m = _PARSABLE.match(line.strip())
        if m:
            return int(m.group(1))
    raise SubmitError(f"no job id in sbatch's output: {output.strip()!r}")


def parse_scontrol_show_job(text: str) -> Dict[str, str]:
    """``scontrol show job ID`` (or ``-o`` one-line) output as a dict of its Key=Value pairs.

    Values may contain spaces only for the last keys on a line (``Command=``, ``WorkDir=``,
    ``StdOut=`` are alone on their lines in the multi-line form), which this keeps whole.
    """
    info: Dict[str, str] = {}
    for line in text.splitlines():
        info.update(key_values(line.strip()))
    return info


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise SubmitError(
            f"{tool} not found on PATH; this machine is not a SLURM submit host.\n"
            "HINT: run on the cluster's login node, or start a local test cluster with "
            "`sudo slurm/local-cluster.sh start`"
        )
    return path


def sbatch(
    script: Path,
    args: Sequence[str] = (),
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[Path] = None,
    timeout: float = 60,
) -> int:
    """``sbatch [args] SCRIPT``; returns the job id. Raises SubmitError with sbatch's message."""
    exe = _require("sbatch")
    try:
        done = subprocess.run(
            [exe, *args, str(script)], capture_output=True, text=True, env=None if env is None else dict(env),
            cwd=None if cwd is None else str(cwd), timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise SubmitError(f"sbatch did not answer within {timeout:.0f} s; is slurmctld up? (sinfo)") from None
    if done.returncode != 0:
        raise SubmitError(
            f"sbatch refused {script} (exit {done.returncode}): {(done.stderr or done.stdout).strip()}"
        )
    return parse_job_id(done.stdout)


def job_info(job_id: int) -> Dict[str, str]:
    """``scontrol show job`` as a dict; empty when SLURM no longer knows the job."""
    done = subprocess.run(
        [_require("scontrol"), "show", "job", str(job_id)], capture_output=True, text=True, timeout=30
    )
    return parse_scontrol_show_job(done.stdout) if done.returncode == 0 else {}


def job_state(job_id: int) -> Optional[str]:
    """The job's state (PENDING, RUNNING, COMPLETED, …), or None when SLURM forgot it."""
    done = subprocess.run(
        [_require("squeue"), "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True, timeout=30
    )
    state = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""
    if state:
        return state
    return job_info(job_id).get("JobState")


def wait_for_job(job_id: int, timeout: float = 300, poll: float = 0.5) -> Dict[str, str]:
    """Poll until the job has ended; return ``scontrol show job``'s final record.

    ``squeue`` lists only pending, running and completing jobs; when it stops listing this
    one, ``scontrol show job`` must also show a final state (:data:`FINAL_STATES`) — a job
    being requeued passes through states squeue hides, and a loaded slurmctld can make
    squeue fail for a moment: both keep the wait going. Returns ``{}`` when SLURM has
    forgotten the job (``MinJobAge``). (``sbatch --wait`` polls at 2 s, then 10 s, then 32 s;
    this polls every ``poll`` s.) Raises TimeoutError (naming the last state) when the job
    has not ended after ``timeout``.
    """
    deadline = time.monotonic() + timeout
    state: Optional[str] = None
    while time.monotonic() < deadline:
        done = subprocess.run(
            [_require("squeue"), "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True, timeout=30
        )
        state = done.stdout.strip() if done.returncode == 0 else None
        if not state:
            info = job_info(job_id)
            if has_ended(info):
                return info
            state = info.get("JobState")
        time.sleep(poll)
    raise TimeoutError(f"job {job_id} still {state or 'queued'} after {timeout:.0f} s")


def has_ended(info: Mapping[str, str]) -> bool:
    """True for ``scontrol show job``'s record of an ended job, or for ``{}`` (forgotten)."""
    return not info or info.get("JobState", "") in FINAL_STATES


# ---------------------------------------------------------------------------- day-2: status, cancel
class UnknownJobError(SubmitError):
    """No SLURM tool knows the job (never existed, or forgotten: MinJobAge, no accounting)."""


def _run(tool: str, args: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([_require(tool), *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SubmitError(f"{tool} did not answer within {timeout:.0f} s\n"
                          "HINT: is slurmctld up? check with `sinfo`") from None


def squeue_rows(job: Optional[JobRef] = None, user: Optional[str] = None) -> List[JobRow]:
    """Pending/running jobs from ``squeue``: one job (its array tasks too), or a user's, or all."""
    from hpctrain.slurm.jobs import parse_squeue, squeue_format

    args = ["-h", "-o", squeue_format()]
    args += ["-j", job.job_arg] if job is not None else (["-u", user] if user else [])
    done = _run("squeue", args)
    if done.returncode != 0:
        if job is not None and "Invalid job id" in done.stderr:
            return []  # squeue forgets a job as soon as it has left the queue
        raise SubmitError(f"squeue failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()}")
    return parse_squeue(done.stdout)


def scontrol_rows(job: JobRef) -> List[JobRow]:
    """``scontrol show job``'s records (with the exact StdOut/StdErr); [] once slurmctld forgot it."""
    from hpctrain.slurm.jobs import parse_scontrol_records, row_from_scontrol

    done = _run("scontrol", ["show", "job", job.job_arg])
    if done.returncode != 0:
        return []
    return [row_from_scontrol(r) for r in parse_scontrol_records(done.stdout)]


def sacct_rows(job: JobRef) -> List[JobRow]:
    """``sacct`` rows of the job and its steps; [] when sacct is absent or accounting is off."""
    from hpctrain.slurm.jobs import SACCT_FIELDS, accounting_disabled, parse_sacct

    if not shutil.which("sacct"):
        return []
    done = _run("sacct", ["-j", job.job_arg, "--parsable2", "-o", ",".join(SACCT_FIELDS)])
    if done.returncode != 0:
        if accounting_disabled(done.stderr):
            return []
        raise SubmitError(f"sacct failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()}")
    return parse_sacct(done.stdout)


def find_job(job: JobRef) -> List[JobRow]:
    """The job's rows from the first tool that knows it: scontrol (while slurmctld holds the
    job: exact log paths), then sacct (after that, if the cluster keeps accounting).
    Raises UnknownJobError when neither does."""
    rows = scontrol_rows(job) or sacct_rows(job)
    if not rows:
        raise UnknownJobError(
            f"job {job} is not known to SLURM (scontrol show job and sacct have no record of it)\n"
            "HINT: check the id with `hpctrain slurm status`; a finished job is forgotten after "
            "MinJobAge unless the cluster keeps accounting (sacct)")
    return rows


def scancel(job: JobRef) -> None:
    """``scancel JOB`` (a step such as ``123.0`` cancels only that step); SubmitError with
    scancel's message when it refuses."""
    done = _run("scancel", [str(job)])
    if done.returncode != 0:
        raise SubmitError(f"scancel {job} failed (exit {done.returncode}): "
                          f"{(done.stderr or done.stdout).strip()}")
