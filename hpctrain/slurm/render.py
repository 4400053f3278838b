"""Render sbatch scripts from the templates (pure: text in, text out).

Every value that reaches a script is shell-quoted (:func:`shlex.quote`) by the template
engine itself: Jinja's ``finalize`` hook quotes the result of every ``{{ … }}``, so a
template cannot forget to. The only unquoted insertions are :class:`Shell` values, which
this module builds from quoted parts (the command line). Values that would break out of an
``#SBATCH`` comment line (newlines, other control characters) are rejected, not quoted.

The templates are the ``*.sbatch`` files of the top-level ``slurm/`` folder, installed as the
package ``hpctrain.templates`` and read through :mod:`importlib.resources`, so an editable
install and a wheel render the same files. A path to any other file renders that file as a
custom template with the same variables (it may include the shipped ``_*.sbatch`` parts).
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = [
    "JobSpec",
    "Shell",
    "TemplateInfo",
    "TEMPLATES",
    "template_files",
    "render",
    "make_spec",
    "quote_command",
    "template_path",
    "parse_time_limit",
]

TEMPLATE_PACKAGE = "hpctrain.templates"
LAUNCHERS = ("srun", "mpirun", "none")

# Placeholders in the command of an array job, replaced by the array variables at run time.
ARRAY_PLACEHOLDERS = {
    "{task}": "${SLURM_ARRAY_TASK_ID}",
    "{task_count}": "${SLURM_ARRAY_TASK_COUNT}",
    "{task_min}": "${SLURM_ARRAY_TASK_MIN}",
    "{task_max}": "${SLURM_ARRAY_TASK_MAX}",
}

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_ARRAY = re.compile(r"^\d+(-\d+(:\d+)?)?(,\d+(-\d+(:\d+)?)?)*(%\d+)?$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_MAX_SIGNAL_SECONDS = 65535  # sbatch --signal accepts at most 0xffff seconds


class Shell(str):
    """Text that is already valid, safe shell (built from quoted parts): inserted verbatim."""


def _finalize(value: Any) -> str:
    if isinstance(value, Shell):
        return str(value)
    if isinstance(value, bool) or value is None:
        raise TypeError(f"template inserted {value!r}; use {{% if %}} for optional values")
    if isinstance(value, int):
        return str(value)
    return shlex.quote(str(value))


def parse_time_limit(text: str) -> Optional[int]:
    """Seconds in a SLURM ``--time`` value; None for UNLIMITED/INFINITE.

    Formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S. Raises ValueError otherwise.
    """
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.match(text)
    if not m:
        raise ValueError(
            f"--time {text!r} is not a SLURM time limit; expected minutes, MM:SS, HH:MM:SS, "
            "D-HH, D-HH:MM or D-HH:MM:SS (e.g. 02:00:00)"
        )
    days, a, b, c = m.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = int(a), int(b or 0), int(c or 0)
        return int(days) * 86400 + h * 3600 + mi * 60 + s
    if b is None:  # M
        return int(a) * 60
    if c is None:  # M:S
        return int(a) * 60 + int(b)
    return int(a) * 3600 + int(b) * 60 + int(c)  # H:M:S


def quote_command(argv: Sequence[str], placeholders: Optional[Mapping[str, str]] = None) -> Shell:
    """Quote a command word by word; ``placeholders`` map literal text to shell expansions.

    ``quote_command(["x", "out{task}.h5"], ARRAY_PLACEHOLDERS)`` ->
    ``x out"${SLURM_ARRAY_TASK_ID}".h5`` — the expansion is double-quoted, the rest single.
    """
    words = []
    for word in argv:
        if not placeholders:
            words.append(shlex.quote(word))
            continue
        pattern = "(" + "|".join(re.escape(p) for p in placeholders) + ")"
        parts = [p for p in re.split(pattern, word) if p != ""]
        if not parts:
            words.append("''")
            continue
        words.append(
            "".join(f'"{placeholders[p]}"' if p in placeholders else shlex.quote(p) for p in parts)
        )
    return Shell(" ".join(words))


@dataclass(frozen=True)
class JobSpec:
    """Everything a template needs; validated on construction (ValueError says the fix)."""

    command: Tuple[str, ...]
    job_name: str = "hpctrain"
    nodes: int = 1
    tasks_per_node: int = 2
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    time: str = "01:00:00"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    mem: Optional[str] = None
    constraint: Optional[str] = None
    output: str = "%x-%j.out"
    error: Optional[str] = "%x-%j.err"
    chdir: Optional[str] = None
    signal_seconds: int = 120
    launcher: str = "srun"
    modules: Tuple[str, ...] = ()
    venv: Optional[str] = None
    env_setup: Optional[str] = None
    exports: Tuple[Tuple[str, str], ...] = ()
    array: Optional[str] = None
    sbatch_args: Tuple[str, ...] = ()
    elastic_min_ranks: int = 0

    def __post_init__(self) -> None:
        if not self.command or not all(isinstance(w, str) for w in self.command):
            raise ValueError(
                "no command to run; put it after `--`, e.g. "
                "hpctrain slurm render cpu-mpi -- python -m hpctrain.cli.main selfcheck"
            )
        if any("\x00" in w for w in self.command):
            raise ValueError("the command contains a NUL character, which no program argument can hold")
        for f in fields(self):
            if f.name == "command":
                continue  # quoted into the script body, where newlines are safe inside quotes
            value = getattr(self, f.name)
            for item in _strings(value):
                if _CONTROL.search(item):
                    raise ValueError(
                        f"{option_name(f.name)} value {item!r} contains a newline or another control "
                        "character; it would break out of its #SBATCH line. Remove it."
                    )
        for name in ("nodes", "tasks_per_node", "cpus_per_task"):
            if getattr(self, name) < 1:
                raise ValueError(f"{option_name(name)} must be at least 1, got {getattr(self, name)}")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node must be 0 or more, got {self.gpus_per_node}")
        for name in ("job_name", "output", "partition", "account", "qos", "mem", "constraint",
                     "error", "chdir", "venv", "env_setup"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{option_name(name)} is empty; leave the option out instead")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"--launcher {self.launcher!r} is unknown; expected one of {', '.join(LAUNCHERS)}")
        self._check_elastic()
        limit = parse_time_limit(self.time)
        if not 0 <= self.signal_seconds <= _MAX_SIGNAL_SECONDS:
            raise ValueError(
                f"--signal-seconds must be between 0 and {_MAX_SIGNAL_SECONDS}, got {self.signal_seconds}"
            )
        if limit is not None and self.signal_seconds >= limit:
            raise ValueError(
                f"--signal-seconds {self.signal_seconds} is not shorter than the time limit "
                f"{self.time!r} ({limit} s): the preemption warning would come at the start. "
                "HINT: use a longer --time or a smaller --signal-seconds"
            )
        for name, value in self.exports:
            if not _IDENT.match(name):
                raise ValueError(
                    f"--export {name}={value!r}: {name!r} is not a shell variable name "
                    "(letters, digits, underscore; not starting with a digit)"
                )
        if self.array is not None and not _ARRAY.match(self.array):
            raise ValueError(
                f"--array {self.array!r} is not a SLURM array spec; expected e.g. 0-15, 1,3,5, "
                "0-31:2 or 0-99%10"
            )
        for arg in self.sbatch_args:
            if not arg.startswith("--") or len(arg) < 3:
                raise ValueError(
                    f"--sbatch-arg {arg!r} must be a long sbatch option such as --exclusive "
                    "or --mail-type=END"
                )

    def _check_elastic(self) -> None:
        if not self.elastic_min_ranks:
            return
        if self.launcher != "mpirun":
            raise ValueError(
                "--elastic-min-ranks needs --launcher mpirun: under srun --mpi=pmix, SLURM's PMIx plugin "
                "cancels the whole job step when one task dies (Slurm's pmix_v4 plugin, measured), so the "
                "survivors cannot go on. HINT: add --launcher mpirun (Open MPI 5 with ULFM; docs/elastic.md)")
        if not 1 <= self.elastic_min_ranks <= self.ntasks:
            raise ValueError(f"--elastic-min-ranks must be between 1 and the job's {self.ntasks} tasks, got "
                             f"{self.elastic_min_ranks}")

    @property
    def ntasks(self) -> int:
        return self.nodes * self.tasks_per_node


def _strings(value: Any) -> List[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, tuple):
        return [s for item in value for s in _strings(item)]
    return []


_CLI_NAMES = {"modules": "--module", "exports": "--export", "sbatch_args": "--sbatch-arg"}


def option_name(field_name: str) -> str:
    """The command-line option of a JobSpec field (for messages)."""
    return _CLI_NAMES.get(field_name, "--" + field_name.replace("_", "-"))


@dataclass(frozen=True)
class TemplateInfo:
    """A shipped template: what it is for, which options apply, and its defaults."""

    name: str
    summary: str
    options: Tuple[str, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)  # values a user may not change
    array_placeholders: bool = False

    @property
    def filename(self) -> str:
        return f"{self.name}.sbatch"

    def file(self) -> Traversable:
        """Where the installed template is (a path for every install made by pip)."""
        return template_files() / self.filename


_COMMON = ("job_name", "time", "partition", "account", "qos", "mem", "constraint", "output",
           "error", "chdir", "signal_seconds", "modules", "venv", "env_setup", "exports",
           "sbatch_args", "cpus_per_task", "launcher", "elastic_min_ranks")

TEMPLATES: Dict[str, TemplateInfo] = {
    t.name: t
    for t in (
        TemplateInfo(
            "cpu-mpi",
            "N nodes x T MPI tasks on CPUs, launched with `srun --mpi=pmix` or `mpirun`",
            _COMMON + ("nodes", "tasks_per_node"),
            defaults={"nodes": 1, "tasks_per_node": 2, "launcher": "srun"},
        ),
        TemplateInfo(
            "gpu-single-node",
            "one node, one rank per GPU (all the node's GPUs visible to every rank: NVLink/P2P)",
            _COMMON + ("gpus_per_node",),
            defaults={"gpus_per_node": 4, "cpus_per_task": 8, "launcher": "srun"},
            fixed={"nodes": 1},
        ),
        TemplateInfo(
            "gpu-multi-node",
            "N nodes x G GPUs, one rank per GPU (--gpus-per-task=1, --gpu-bind=closest)",
            _COMMON + ("nodes", "gpus_per_node"),
            defaults={"nodes": 2, "gpus_per_node": 4, "cpus_per_task": 8, "launcher": "srun"},
        ),
        TemplateInfo(
            "data-shard-array",
            "a job array: one task per shard; {task} in the command becomes the array index",
            _COMMON + ("array", "tasks_per_node"),
            defaults={"array": "0-3", "tasks_per_node": 1, "launcher": "none",
                      "output": "%x-%A_%a.out", "error": "%x-%A_%a.err", "time": "00:30:00",
                      "signal_seconds": 60},
            fixed={"nodes": 1},
            array_placeholders=True,
        ),
    )
}


def template_files() -> Traversable:
    """The installed templates folder (package ``hpctrain.templates``)."""
    return resources.files(TEMPLATE_PACKAGE)


def template_path(name_or_path: str) -> Traversable:
    """The file of a shipped template name, or ``name_or_path`` itself when it is a file."""
    if name_or_path in TEMPLATES:
        return TEMPLATES[name_or_path].file()
    path = Path(name_or_path)
    if path.is_file():
        return path
    raise ValueError(
        f"unknown template {name_or_path!r}; shipped templates: {', '.join(TEMPLATES)} "
        "(or give the path of your own template file). HINT: hpctrain slurm list"
    )


def make_spec(template: str, command: Sequence[str], **options: Any) -> JobSpec:
    """A validated JobSpec for ``template``: its defaults, then ``options`` (None = default).

    An option the template does not use raises ValueError listing the ones it does.
    """
    info = TEMPLATES.get(template)
    valid = set(info.options) if info else {f.name for f in fields(JobSpec)} - {"command"}
    given = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(given) - valid)
    if unknown:
        allowed = " ".join(sorted(option_name(o) for o in valid))
        raise ValueError(
            f"option {', '.join(option_name(u) for u in unknown)} does not apply to template "
            f"{template!r}; its options are: {allowed}"
        )
    values: Dict[str, Any] = dict(info.defaults) if info else {}
    values.update(given)
    if info:
        values.update(info.fixed)
        if "gpus_per_node" in info.options:
            # One rank per GPU: the task count per node follows the GPU count.
            if values.get("gpus_per_node", 0) < 1:
                raise ValueError(f"template {template!r} needs --gpus-per-node of at least 1")
            values["tasks_per_node"] = values["gpus_per_node"]
    for key in ("modules", "sbatch_args"):
        if key in values:
            values[key] = tuple(values[key])
    if "exports" in values:
        values["exports"] = tuple((str(k), str(v)) for k, v in (
            values["exports"].items() if isinstance(values["exports"], Mapping) else values["exports"]))
    return JobSpec(command=tuple(command), **values)


def _load_shipped(name: str) -> Optional[str]:
    """Jinja's loader: a shipped template or part (``{% include "_header.sbatch" %}``)."""
    file = template_files() / name
    return file.read_text() if file.is_file() else None


def _environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FunctionLoader(_load_shipped),
        finalize=_finalize,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template: str, spec: JobSpec) -> str:
    """The sbatch script for ``template`` (a shipped name or a file path) and ``spec``."""
    from hpctrain import __version__

    path = template_path(template)
    env = _environment()
    info = TEMPLATES.get(template)
    tmpl = env.get_template(info.filename) if info else env.from_string(path.read_text())
    placeholders = ARRAY_PLACEHOLDERS if (info and info.array_placeholders) or spec.array else None
    context: Dict[str, Any] = {f.name: getattr(spec, f.name) for f in fields(spec)}
    context.update(
        template=info.name if info else path.name,
        version=__version__,
        ntasks=spec.ntasks,
        command=quote_command(spec.command, placeholders),
    )
    text = tmpl.render(**context)
    # Collapse the blank lines optional blocks leave behind.
    return re.sub(r"\n{3,}", "\n\n", text)


def current_venv() -> Optional[str]:
    """This Python's virtual environment, when it runs in one (the `--venv auto` default)."""
    return sys.prefix if sys.prefix != getattr(sys, "base_prefix", sys.prefix) else None


def with_options(spec: JobSpec, **changes: Any) -> JobSpec:
    """A copy of ``spec`` with ``changes`` (validated again)."""
    return replace(spec, **changes)
