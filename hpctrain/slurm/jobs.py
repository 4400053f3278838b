"""Pure parsing for ``hpctrain slurm status | cancel | logs``: job ids, ``squeue``/``sacct``/
``scontrol show job`` output as rows, and where a job's output files are.

Nothing here runs a command (that is :mod:`hpctrain.slurm.submit`); every function takes
text and returns data, so it is unit-tested against captured outputs.

``--parsable2`` (``|``-separated) is read rather than ``--json``: the JSON output needs an
optional plugin that many sites do not install, and its schema changes between SLURM
releases (``job_state`` a string in 22.05, a list from 23.02), while the column output of
named fields is the same everywhere.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

__all__ = [
    "JobRef",
    "JobRow",
    "parse_job_ref",
    "SQUEUE_FIELDS",
    "squeue_format",
    "parse_squeue",
    "SACCT_FIELDS",
    "parse_sacct",
    "accounting_disabled",
    "key_values",
    "parse_scontrol_records",
    "row_from_scontrol",
    "expand_pattern",
    "OUTPUT_PATTERNS",
    "log_candidates",
    "format_rows",
    "FINAL_STATES",
]

# States after which a job (or this run of it) does not change any more.
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
     "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
)

_JOB_REF = re.compile(r"^(\d+)(?:_(\d+))?(?:\.(\d+|batch|extern|interactive))?$")


@dataclass(frozen=True)
class JobRef:
    """A job as a user names it: ``123`` (a job, or a whole array), ``123_4`` (one array
    task), ``123.0`` / ``123.batch`` (a step; status/logs/cancel act on its job)."""

    job: int
    task: Optional[int] = None
    step: Optional[str] = None

    @property
    def job_arg(self) -> str:
        """The id to pass to squeue/scontrol/sacct/scancel (the step is dropped)."""
        return f"{self.job}_{self.task}" if self.task is not None else str(self.job)

    def __str__(self) -> str:
        return self.job_arg + (f".{self.step}" if self.step is not None else "")


def parse_job_ref(text: str) -> JobRef:
    """``"123"``, ``"123_4"``, ``"123.0"``, ``"123_4.batch"`` -> :class:`JobRef`; ValueError otherwise."""
    m = _JOB_REF.match(str(text).strip())
    if not m:
        raise ValueError(f"{text!r} is not a SLURM job id; expected e.g. 123, 123_4 (array task) or 123.0 (step)\n"
                         "HINT: `hpctrain slurm status` lists your jobs with their ids")
    task = int(m.group(2)) if m.group(2) is not None else None
    return JobRef(int(m.group(1)), task, m.group(3))


@dataclass(frozen=True)
class JobRow:
    """One job (or array task, or step) as squeue, sacct or scontrol describe it.

    Fields a source does not give are ``""``. ``state`` is the base state (``CANCELLED``
    for sacct's ``CANCELLED by 0``)."""

    job_id: str
    name: str = ""
    state: str = ""
    elapsed: str = ""
    time_limit: str = ""
    nodes: str = ""
    reason: str = ""
    exit_code: str = ""
    work_dir: str = ""
    stdout: str = ""
    stderr: str = ""
    user: str = ""
    source: str = ""

    @property
    def ended(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def is_step(self) -> bool:
        return "." in self.job_id


def _base_state(state: str) -> str:
    # sacct: "CANCELLED by 0"; squeue/scontrol may add "+" flags in some releases.
    return state.split()[0].rstrip("+") if state.strip() else ""


# ---------------------------------------------------------------------------- squeue
# (field name, squeue -o letter). %R is the reason while pending, the node list after.
SQUEUE_FIELDS = (("job_id", "%i"), ("name", "%j"), ("state", "%T"), ("elapsed", "%M"),
                 ("time_limit", "%l"), ("nodes", "%R"), ("user", "%u"))


def squeue_format() -> str:
    """The ``squeue -o`` format whose output :func:`parse_squeue` reads (``|``-separated)."""
    return "|".join(letter for _name, letter in SQUEUE_FIELDS)


def parse_squeue(text: str) -> List[JobRow]:
    """``squeue -h -o <squeue_format()>`` output -> rows (the job name may contain ``|``)."""
    rows = []
    n = len(SQUEUE_FIELDS)
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) < n:
            raise ValueError(f"unexpected squeue line (expected {n} '|'-separated fields): {line!r}")
        extra = len(parts) - n  # a '|' inside the job name
        parts = parts[:1] + ["|".join(parts[1:2 + extra])] + parts[2 + extra:]
        values = dict(zip((name for name, _ in SQUEUE_FIELDS), parts))
        state = _base_state(values["state"])
        pending = state == "PENDING"
        rows.append(JobRow(job_id=values["job_id"], name=values["name"], state=state,
                           elapsed=values["elapsed"], time_limit=values["time_limit"],
                           nodes="" if pending else values["nodes"],
                           reason=values["nodes"].strip("()") if pending else "",
                           user=values["user"], source="squeue"))
    return rows


# ---------------------------------------------------------------------------- sacct
SACCT_FIELDS = ("JobID", "JobName", "State", "Elapsed", "Timelimit", "NodeList", "ExitCode", "WorkDir", "User")


def parse_sacct(text: str) -> List[JobRow]:
    """``sacct --parsable2 -o <SACCT_FIELDS>`` output (header line first) -> rows.

    Steps (``123.batch``, ``123.0``) are rows too; ``WorkDir`` and ``User`` are filled only
    on the job's own row, so steps inherit them from it."""
    lines = [l for l in text.splitlines() if l.strip()]
    if not lines:
        return []
    header = lines[0].split("|")
    if "JobID" not in header or "State" not in header:
        raise ValueError(f"unexpected sacct header (expected --parsable2 with JobID and State): {lines[0]!r}")
    rows: List[JobRow] = []
    parent: Dict[str, JobRow] = {}
    for line in lines[1:]:
        parts = line.split("|")
        if len(parts) != len(header):
            raise ValueError(f"unexpected sacct line ({len(parts)} fields, header has {len(header)}): {line!r}")
        v = dict(zip(header, parts))
        job_id = v["JobID"]
        row = JobRow(job_id=job_id, name=v.get("JobName", ""), state=_base_state(v["State"]),
                     elapsed=v.get("Elapsed", ""), time_limit=v.get("Timelimit", ""), nodes=v.get("NodeList", ""),
                     exit_code=v.get("ExitCode", ""), work_dir=v.get("WorkDir", ""), user=v.get("User", ""),
                     source="sacct")
        owner = parent.get(job_id.split(".")[0])
        if owner is not None and "." in job_id:
            row = replace(row, work_dir=row.work_dir or owner.work_dir, user=row.user or owner.user)
        else:
            parent[job_id] = row
        rows.append(row)
    return rows


def accounting_disabled(stderr: str) -> bool:
    """True when sacct says the cluster keeps no accounting (then only squeue/scontrol know jobs)."""
    return bool(re.search(r"accounting storage is disabled|accounting_storage/none|"
                          r"Problem talking to the database|Connection refused", stderr, re.I))


# ---------------------------------------------------------------------------- scontrol
def key_values(line: str) -> Dict[str, str]:
    """One line of ``scontrol show`` output as its ``Key=Value`` pairs."""
    # Keys start a line or follow a space; a value runs to the next key, so values with
    # spaces (Command=, WorkDir=, StdOut=, alone on their lines) stay whole.
    out: Dict[str, str] = {}
    starts = [m.start() for m in re.finditer(r"(?:(?<=\s)|^)[A-Za-z][A-Za-z0-9_:/]*=", line)]
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(line)
        key, _, value = line[start:end].strip().partition("=")
        out[key] = value
    return out


def parse_scontrol_records(text: str) -> List[Dict[str, str]]:
    """``scontrol show job ID`` output -> one dict per job record (an array job gives one
    per task; records are separated by blank lines, or are one line each with ``-o``)."""
    records: List[Dict[str, str]] = []
    current: Dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("JobId=") and current:
            records.append(current)
            current = {}
        if not line:
            if current:
                records.append(current)
                current = {}
            continue
        current.update(key_values(line))
    if current:
        records.append(current)
    return [r for r in records if "JobId" in r]


def row_from_scontrol(rec: Mapping[str, str]) -> JobRow:
    """One :func:`parse_scontrol_records` record as a :class:`JobRow`."""
    job_id = rec.get("JobId", "")
    if rec.get("ArrayJobId") and rec.get("ArrayTaskId") not in (None, "", "N/A"):
        job_id = f"{rec['ArrayJobId']}_{rec['ArrayTaskId']}"
    state = _base_state(rec.get("JobState", ""))
    reason = rec.get("Reason", "")
    return JobRow(job_id=job_id, name=rec.get("JobName", ""), state=state, elapsed=rec.get("RunTime", ""),
                  time_limit=rec.get("TimeLimit", ""),
                  nodes="" if rec.get("NodeList") in (None, "(null)") else rec["NodeList"],
                  reason="" if reason == "None" else reason, exit_code=rec.get("ExitCode", ""),
                  work_dir=rec.get("WorkDir", ""), stdout=rec.get("StdOut", ""), stderr=rec.get("StdErr", ""),
                  user=rec.get("UserId", "").split("(")[0], source="scontrol")


# ---------------------------------------------------------------------------- log files
# The --output/--error patterns hpctrain writes: `hpctrain slurm submit` (run directory,
# slurm-%j / slurm-%A_%a), the templates' defaults (%x-%j, arrays %x-%A_%a, relative to
# the job's working directory), and sbatch's own default (slurm-%j.out, stdout and stderr
# in one file).
OUTPUT_PATTERNS = {
    "out": ("%x-%j.out", "%x-%A_%a.out", "slurm-%j.out", "slurm-%A_%a.out", "runs/%x/slurm-%j.out",
            "runs/%x/slurm-%A_%a.out"),
    "err": ("%x-%j.err", "%x-%A_%a.err", "slurm-%j.err", "slurm-%A_%a.err", "runs/%x/slurm-%j.err",
            "runs/%x/slurm-%A_%a.err", "slurm-%j.out", "slurm-%A_%a.out"),
}

_PATTERN = re.compile(r"%(\d*)([%AajxuNnst])")


def expand_pattern(pattern: str, *, job_id: int, name: str = "", array_job: Optional[int] = None,
                   task: Optional[int] = None, user: str = "", node: str = "") -> str:
    """sbatch's ``--output`` filename pattern with this job's values (``%j %A %a %x %u %N %%``,
    with an optional zero-padding width such as ``%4a``). ``%A``/``%a`` outside an array
    take the job id / 4294967294, as sbatch does."""
    values = {"j": str(job_id), "A": str(array_job if array_job is not None else job_id),
              "a": str(task if task is not None else 4294967294), "x": name, "u": user, "N": node,
              "n": "0", "s": "batch", "t": "0"}

    def sub(m: "re.Match[str]") -> str:
        width, letter = m.group(1), m.group(2)
        if letter == "%":
            return "%"
        value = values[letter]
        return value.zfill(int(width)) if width and value.isdigit() else value

    return _PATTERN.sub(sub, pattern)


def log_candidates(row: JobRow, stream: str = "out", patterns: Optional[Iterable[str]] = None) -> List[str]:
    """Where ``row``'s stdout (``stream="out"``) or stderr (``"err"``) can be, best first.

    scontrol's ``StdOut``/``StdErr`` are exact (sbatch already expanded the pattern); from
    sacct only ``WorkDir`` is known, so the patterns hpctrain's templates use are tried in it.
    """
    exact = row.stdout if stream == "out" else row.stderr
    if exact:
        return [exact]
    if not row.work_dir:
        return []
    ref = parse_job_ref(row.job_id)
    array_job = ref.job if ref.task is not None else None
    out = []
    for pattern in patterns if patterns is not None else OUTPUT_PATTERNS[stream]:
        path = expand_pattern(pattern, job_id=ref.job, name=row.name, array_job=array_job, task=ref.task,
                              user=row.user)
        full = str(PurePosixPath(row.work_dir) / path)
        if full not in out:
            out.append(full)
    return out


def format_rows(rows: Sequence[JobRow]) -> str:
    """A fixed-width table: JOBID NAME STATE TIME LIMIT NODES/REASON [EXIT]."""
    header = ("JOBID", "NAME", "STATE", "TIME", "LIMIT", "NODES/REASON", "EXIT")
    table = [header] + [(r.job_id, r.name, r.state, r.elapsed, r.time_limit,
                         r.nodes if r.nodes else (f"({r.reason})" if r.reason else ""), r.exit_code) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)
