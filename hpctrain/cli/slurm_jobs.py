"""``hpctrain slurm status | cancel | logs``: follow and stop jobs after submitting them.

  hpctrain slurm status [JOB]              your queued/running jobs, or one job (also after it ended)
  hpctrain slurm cancel JOB                scancel it and wait until SLURM says CANCELLED
  hpctrain slurm logs JOB [--err] [-f]     print its output file (-f: follow until the job ends)

JOB is ``123``, ``123_4`` (array task) or ``123.0`` (a step: cancel acts on that step only).
Registered under ``hpctrain slurm`` by :func:`register`.
"""
from __future__ import annotations

import argparse
import getpass
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, TextIO

if TYPE_CHECKING:  # pragma: no cover - imported when a verb runs (keeps `--help` light)
    from hpctrain.slurm.jobs import JobRef, JobRow

EXAMPLES = """examples:
  hpctrain slurm status
  hpctrain slurm status 4242
  hpctrain slurm logs 4242 --follow
  hpctrain slurm logs 4242_3 --err
  hpctrain slurm cancel 4242
"""

POLL_S = 0.5


def _job(text: str) -> JobRef:
    from hpctrain.slurm.jobs import parse_job_ref

    try:
        return parse_job_ref(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _own(rows: List[JobRow], ref: JobRef) -> List[JobRow]:
    """The rows naming ``ref`` itself: its step when a step was named, else the job (or its
    array tasks) without steps."""
    if ref.step is not None:
        return [r for r in rows if r.job_id == str(ref)] or [r for r in rows if not r.is_step]
    return [r for r in rows if not r.is_step]


def cmd_status(args: argparse.Namespace) -> int:
    from hpctrain.slurm.jobs import format_rows
    from hpctrain.slurm.submit import find_job, squeue_rows

    if args.job is None:
        user = None if args.all else (os.environ.get("USER") or getpass.getuser())
        rows = squeue_rows(user=user)
        if not rows:
            print(f"no queued or running jobs{'' if user is None else ' for user ' + user}", file=sys.stderr)
            return 0
    else:
        rows = find_job(args.job)
        rows = rows if args.steps else _own(rows, args.job)
    print(format_rows(rows))
    return 0


def _settled(ref: JobRef, timeout: float) -> List[JobRow]:
    from hpctrain.slurm.submit import find_job

    deadline = time.monotonic() + timeout
    rows = _own(find_job(ref), ref)
    while not all(r.ended for r in rows) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        rows = _own(find_job(ref), ref)
    return rows


def cmd_cancel(args: argparse.Namespace) -> int:
    from hpctrain.slurm.submit import find_job, scancel

    rows = _own(find_job(args.job), args.job)
    if rows and all(r.ended for r in rows):
        states = ", ".join(sorted({r.state for r in rows}))
        print(f"hpctrain slurm cancel: job {args.job} already ended ({states}); nothing to cancel", file=sys.stderr)
        return 0
    scancel(args.job)
    if args.job.step is not None:  # the job goes on; only the step ends
        print(f"hpctrain slurm cancel: cancelled step {args.job}", file=sys.stderr)
        return 0
    rows = _settled(args.job, args.wait)
    states = ", ".join(sorted({r.state for r in rows})) or "gone"
    print(f"hpctrain slurm cancel: job {args.job}: {states}", file=sys.stderr)
    return 0


def _pick_row(ref: JobRef, rows: List[JobRow]) -> JobRow:
    own = [r for r in _own(rows, ref) if not r.is_step]
    if len(own) > 1:
        ids = " ".join(r.job_id for r in own[:8]) + (" …" if len(own) > 8 else "")
        raise ValueError(f"job {ref} is an array of {len(own)} tasks, each with its own log: {ids}\n"
                         f"HINT: name one task, e.g. hpctrain slurm logs {own[-1].job_id}")
    if not own:
        raise ValueError(f"no record of job {ref} itself (only of its steps)")
    return own[0]


def _log_path(ref: JobRef, row: JobRow, stream: str) -> Optional[Path]:
    from hpctrain.slurm.jobs import log_candidates

    candidates = log_candidates(row, stream)
    for c in candidates:
        if Path(c).is_file():
            return Path(c)
    if row.ended or not candidates:
        looked = ", ".join(candidates) or "(SLURM gave neither StdOut nor WorkDir)"
        raise ValueError(f"no {'stderr' if stream == 'err' else 'output'} file for job {ref} ({row.state}); "
                         f"looked at: {looked}\n"
                         "HINT: the file is where the job's --output/--error said, relative to its working "
                         "directory; on a cluster it must be on a file system this machine sees")
    return None  # pending, or running on a node whose file is not there yet


def _copy_new(path: Path, pos: int, out: TextIO) -> int:
    with open(path, "rb") as f:
        f.seek(pos)
        data = f.read()
    if data:
        out.write(data.decode(errors="replace"))
        out.flush()
    return pos + len(data)


def cmd_logs(args: argparse.Namespace) -> int:
    from hpctrain.slurm.submit import UnknownJobError, find_job

    stream = "err" if args.err else "out"
    row = _pick_row(args.job, find_job(args.job))
    path = _log_path(args.job, row, stream)
    if path is None and not args.follow:
        print(f"hpctrain slurm logs: job {args.job} is {row.state}; no output yet "
              f"(expected at {row.stdout if stream == 'out' else row.stderr or row.stdout})\n"
              "HINT: add --follow to wait for it", file=sys.stderr)
        return 1
    if stream == "err" and row.stderr and row.stderr == row.stdout:
        print(f"hpctrain slurm logs: job {args.job} writes stderr and stdout to one file", file=sys.stderr)
    pos = _copy_new(path, 0, sys.stdout) if path is not None else 0
    if not args.follow:
        return 0
    try:
        while True:
            if path is None:
                path = _log_path(args.job, row, stream)
            before = pos
            if path is not None:
                pos = _copy_new(path, pos, sys.stdout)
            if pos == before:
                if row.ended:
                    return 0
                time.sleep(POLL_S)
                try:
                    row = _pick_row(args.job, find_job(args.job))
                except UnknownJobError:
                    from hpctrain.slurm.jobs import JobRow

                    row = JobRow(job_id=row.job_id, state="COMPLETED", stdout=row.stdout, stderr=row.stderr)
    except KeyboardInterrupt:
        return 130


def register(ssub: argparse._SubParsersAction) -> None:
    """Add status, cancel and logs under ``hpctrain slurm``."""
    fmt = argparse.RawDescriptionHelpFormatter
    q = ssub.add_parser("status", help="your queued/running jobs, or one job's state (also after it ended)",
                        description=__doc__, epilog=EXAMPLES, formatter_class=fmt)
    q.add_argument("job", nargs="?", type=_job, help="job id: 123, 123_4 (array task) or 123.0 (step)")
    q.add_argument("--all", action="store_true", help="without JOB: every user's jobs, not only yours")
    q.add_argument("--steps", action="store_true", help="with JOB: list its steps too (from sacct)")
    q.set_defaults(slurm_func=cmd_status)
    q = ssub.add_parser("cancel", help="scancel a job and wait until SLURM reports it CANCELLED",
                        description=__doc__, epilog=EXAMPLES, formatter_class=fmt)
    q.add_argument("job", type=_job, help="job id: 123, 123_4 (array task) or 123.0 (that step only)")
    q.add_argument("--wait", type=float, default=30.0, metavar="S",
                   help="seconds to wait for the final state (default 30)")
    q.set_defaults(slurm_func=cmd_cancel)
    q = ssub.add_parser("logs", help="print a job's output file (--follow: until the job ends)",
                        description=__doc__, epilog=EXAMPLES, formatter_class=fmt)
    q.add_argument("job", type=_job, help="job id: 123 or 123_4 (array task)")
    q.add_argument("--err", action="store_true", help="the stderr file instead of stdout")
    q.add_argument("-f", "--follow", action="store_true", help="keep printing new output until the job ends")
    q.set_defaults(slurm_func=cmd_logs)
