"""Every ``HPCTRAIN_*`` environment variable hpctrain reads: declared once, typed, documented.

Each variable is declared below with its type, default, allowed range or choices and a
one-line doc; the README's table of variables is generated from these declarations
(``python -m hpctrain.settings``) and a unit test keeps the two equal. Read a value as an
attribute of :data:`rc` (``settings.rc.stall_timeout``); an unknown name is an error, as
with mpi4py's ``rc``.

Values are parsed when first read, not at import: ``import hpctrain`` never fails on a bad
value. The parsed value is cached for the life of the process (``reset()`` forgets it, for
tests that change the environment). :func:`check_all` parses every variable at once: the CLI
and ``hpctrain.comm.init()`` call it, so a bad value stops a job at start with one line that
names the variable, the value and the accepted form.

Sizes (:func:`parse_size`) are plain bytes or a number with a unit, case-insensitive:
``K``, ``M``, ``G``, ``T``, with or without ``B`` or ``iB`` (``512KiB``, ``1MiB``, ``64M``,
``1G``, ``4MB``). Every unit is a power of 1024 (``1K`` = ``1KiB`` = ``1KB`` = 1024 bytes), as
SLURM's ``--mem`` and MPI's size options read them. A fraction is allowed when it is a whole
number of bytes (``1.5G``).

A leaf module: it imports nothing of hpctrain, so every package, ``hpctrain.comm``
included, may import it.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

__all__ = ["SettingError", "Setting", "DECLARED", "rc", "get", "read", "reset", "override", "check_all",
           "parse_size", "format_size", "markdown_table"]

PREFIX = "HPCTRAIN_"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_SIZE_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i?b)?|(b))?\s*", re.IGNORECASE)
SIZE_FORM = "bytes, or a number with K, M, G or T (powers of 1024; B or iB may follow): e.g. 512KiB, 1MiB, 64M, 1G"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingError(ValueError):
    """An ``HPCTRAIN_*`` variable holds a value hpctrain cannot use."""


# --------------------------------------------------------------------------- sizes
def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"512KiB"``, ``"1MiB"``, ``"64M"``, ``"1G"``, ``"2 GB"``, ``"1.5G"``.

    Every unit is a power of 1024, with or without ``B``/``iB`` (``1K`` = ``1KB`` = ``1KiB``
    = 1024). Raises ValueError for anything else (negative, unknown unit, fractional bytes)."""
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; expected {SIZE_FORM}")
    number, unit = match.group(1), (match.group(2) or "").lower()
    scale = _SIZE_UNITS[unit]
    if "." not in number:
        return int(number) * scale
    value = float(number) * scale
    if value != math.floor(value):
        raise ValueError(f"cannot read {text!r} as a size: not a whole number of bytes; expected {SIZE_FORM}")
    return int(value)


def format_size(nbytes: int) -> str:
    """``1048576`` → ``"1MiB"``; the largest unit that divides ``nbytes`` (``parse_size`` reads it back)."""
    for unit, factor in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


def _spaced(nbytes: int) -> str:
    """``262144`` → ``"256 KiB"``: the docs' way of writing a size."""
    return re.sub(r"(\d)([KMGT]?i?B)$", r"\1 \2", format_size(nbytes))


# --------------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Setting:
    """One variable: ``HPCTRAIN_<NAME>``. ``kind``: ``flag`` (1/0; default None: hpctrain
    decides), ``seconds`` (a number), ``size`` (see :func:`parse_size`), ``choice`` (one of
    ``choices``) or ``text`` (any string; default None: unset). ``minimum`` bounds seconds and
    sizes; ``shown_default`` is the README's default where ``default`` alone does not say it."""

    name: str
    kind: str
    default: Any
    doc: str
    minimum: Optional[float] = None
    choices: Tuple[str, ...] = ()
    shown_default: str = ""
    zero: str = ""  # what 0 means, where it is allowed and means something special

    def __post_init__(self) -> None:
        assert self.kind in ("flag", "seconds", "size", "count", "choice", "text"), self.kind
        assert self.kind != "choice" or self.default in self.choices, self.name

    @property
    def env(self) -> str:
        """The variable's name: ``HPCTRAIN_`` and the setting's name in capitals."""
        return PREFIX + self.name.upper()

    def expected(self) -> str:
        """The accepted form, in words."""
        if self.kind == "flag":
            return "1 or 0 (or true/false, yes/no, on/off)"
        if self.kind == "seconds":
            zero = f" (0 {self.zero})" if self.zero else ""
            return f"a number of seconds >= {self.minimum:g}{zero}"
        if self.kind == "size":
            zero = f" (0 {self.zero})" if self.zero else ""
            low = int(self.minimum or 0)
            return f"a size >= {_spaced(low) if low else 0}{zero}: {SIZE_FORM}"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "count":
            return f"a whole number >= {int(self.minimum or 0)}"
        return "any text"

    def accepted(self) -> str:
        """The accepted form, short (the README's column)."""
        if self.kind == "flag":
            return "1 or 0" + (" (unset or auto: auto)" if self.default is None else "")
        if self.kind in ("seconds", "size"):
            low = int(self.minimum or 0)
            return f"{self.kind} ≥ {_spaced(low) if low else 0}"
        if self.kind == "count":
            return f"integer ≥ {int(self.minimum or 0)}"
        return ", ".join(self.choices) if self.kind == "choice" else "text"

    def parse(self, raw: Optional[str]) -> Any:
        """The value of ``raw`` (None or blank: the default); SettingError names the variable."""
        if raw is None or raw.strip() == "":
            return self.default
        text = raw.strip()
        try:
            return self.check(self._convert(text))
        except ValueError:
            raise SettingError(f"{self.env}={raw!r}: expected {self.expected()}. HINT: fix or unset {self.env} "
                               f"(unset means the default: {self.default_text()})") from None

    def check(self, value: Any) -> Any:
        """``value`` when it is in range (ValueError otherwise)."""
        if value is None and self.default is None:
            return None
        if self.kind in ("seconds", "size", "count"):
            number = (int, float) if self.kind == "seconds" else int
            if not isinstance(value, number) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{self.name}: {value!r} is not a "
                                 f"{ {'seconds': 'number', 'size': 'byte count'}.get(self.kind, 'whole number')}")
            if self.minimum is not None and value < self.minimum:
                raise ValueError(f"{self.name}: {value!r} is below {self.minimum:g}")
        elif self.kind == "choice" and value not in self.choices:
            raise ValueError(f"{self.name}: {value!r} is not one of {', '.join(self.choices)}")
        elif self.kind == "flag" and not isinstance(value, bool):
            raise ValueError(f"{self.name}: {value!r} is not True or False")
        return value

    def _convert(self, text: str) -> Any:
        if self.kind == "flag":
            if text.lower() == "auto" and self.default is None:
                return None
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(text)
        if self.kind == "seconds":
            return float(text)
        if self.kind == "size":
            return parse_size(text)
        if self.kind == "count":
            return int(text)
        if self.kind == "choice":
            return text.lower()
        return text

    def default_text(self) -> str:
        """The default as the README shows it."""
        if self.shown_default:
            return self.shown_default
        if self.kind == "flag":
            return {True: "1", False: "0"}.get(self.default, "auto")
        if self.kind == "size":
            return _spaced(self.default)
        if self.kind == "seconds":
            return f"{self.default:g}"
        return "unset" if self.default is None else str(self.default)


def _flag(name: str, default: Optional[bool], doc: str) -> Setting:
    return Setting(name, "flag", default, doc)


def _size(name: str, default: Optional[int], minimum: int, doc: str, shown: str = "") -> Setting:
    return Setting(name, "size", default, doc, minimum=minimum, shown_default=shown)


DECLARED: Tuple[Setting, ...] = (
    Setting("stall_timeout", "seconds", 300.0, "seconds a collective may wait before the job is aborted "
            "with a report (0: off)", minimum=0, zero="switches the watchdog off"),
    _flag("check_collectives", True, "per-collective agreement check (shape, dtype, op, order); 0 for speed"),
    _size("check_inband_bytes", 256 * KiB, 0, "where the agreement check runs over MPI (across nodes), an "
          "`auto` all-reduce up to this size sends its data with its check header (with the check off too: "
          "the same messages, faster than `MPI_Allreduce` there) and the ranks reduce it as "
          "they swap headers: one message per step of the check's schedule (two for 60-120 KiB, below TCP's "
          "eager limit), no `MPI_Allreduce` and no run-time "
          "choice (capped so that a rank receives at most 512 KiB of data per check: message x the parts it "
          "takes, its steps and its node's tree levels; 256 KiB at 4 ranks, 128 KiB at 16); rank 0's value holds "
          "for the group; 0: never"),
    Setting("check_schedule", "choice", "leaders", "across nodes, how the agreement check's messages (and the "
            "small all-reduces on them) travel: `leaders`, each node's ranks fold into its lowest rank along a "
            "binomial tree and only the leaders swap across nodes (one message per step per node); `flat`, "
            "recursive doubling over every rank (every rank's part crosses). Compare them on your network with "
            "benchmarks/check_schedule.py; rank 0's value holds for the group",
            choices=("leaders", "flat")),
    Setting("allreduce", "choice", "auto", "force an all-reduce algorithm: ring, native, shm, hierarchical",
            choices=("auto", "ring", "native", "shm", "hierarchical")),
    _flag("autotune", True, "on one node, `auto` times its candidates for private buffers above 256 KiB (the "
          "streamed shm path, `MPI_Allreduce`, and the ring: from 1 MiB at 3 ranks or more, from 32 MiB at 2) and "
          "runs the fastest, re-trying the others now and then; local rank 0 decides, every rank follows (one "
          "flag exchange per run of up to 16 calls of the running best; trials call by call). Across nodes, "
          "from 128 KiB and above the all-reduces that ride on the agreement check's messages "
          "(HPCTRAIN_CHECK_INBAND_BYTES), among "
          "`MPI_Allreduce`, the ring and the hierarchical path: group rank 0 decides and its pick rides on "
          "the agreement check (with the check off, the fixed choice runs). 0 (on any rank of a node; across "
          "nodes rank 0's value: agreed when a group is made): fixed thresholds (reproducible choice)"),
    _size("cross_node_ring_bytes", 256 * KiB, 0, "across nodes, `auto`'s fixed choice (HPCTRAIN_AUTOTUNE=0, "
          "and the first candidate it tries) is the ring from this size (`MPI_Allreduce` below it)"),
    _size("cross_node_hierarchical_bytes", 4 * MiB, 0, "across nodes with the same number of ranks on each, "
          "`auto`'s fixed choice is the hierarchical path from this size (shared-memory reduction on each node, a "
          "ring across nodes)"),
    _flag("ring_c", True, "the ring all-reduce in C (`hpctrain/comm/_mpiring.c`, over the MPI library mpi4py "
          "loaded; agreed across the ranks of a communicator the first time the ring runs on it), and in C each "
          "rank's part of the agreement check over MPI, with a small all-reduce's data on it "
          "(HPCTRAIN_CHECK_INBAND_BYTES; the same messages as the Python one); 0: Python for both"),
    _size("ring_segment_bytes", None, KiB, "ring pipelining segment; 4 segments at a time arrive in cache-sized "
          "scratch slots", shown="512 KiB (C ring), 1 MiB (Python ring)"),
    _flag("shm_flags", True, "on one node, synchronise through shared-memory flags (small all-reduces, agreement "
          "check, barriers of the shm paths); 0: MPI messages"),
    _size("shm_small_bytes", 256 * KiB, KiB, "on one node, all-reduces up to this size are one flag exchange "
          "(each rank reduces every rank's copy); larger ones stream through the flag slots (each rank reduces "
          "its part of every segment)"),
    _size("shm_slot_bytes", 256 * KiB, 4 * KiB, "size of each rank's two flag slots: the largest segment of the "
          "streamed all-reduce (raised to `HPCTRAIN_SHM_SMALL_BYTES` if smaller)"),
    _flag("spin_wait", None, "a rank waiting on the node's shared-memory flags spins for a while before it yields "
          "its core (1) or yields at once (0); auto: spin where the node's ranks have a core each and Open MPI was "
          "not told that the cores are shared (`OMPI_MCA_mpi_yield_when_idle=1`: several nodes' ranks on the "
          "same cores, as in the test cluster, where spinning held a 1 KiB hierarchical all-reduce to ~2 ms)"),
    _size("shm_streaming_bytes", 48 * MiB, 0, "zero-copy all-reduces larger than this (all local slots together) "
          "write results with streaming stores"),
    Setting("fusion_threshold", "size", 4 * MiB, "gradient bucket size of `DistributedOptimizer`; 0: one bucket "
            "per parameter", minimum=0, zero="gives one bucket per parameter"),
    _flag("shared_buckets", True, "keep DistributedOptimizer's buckets in each node's MPI shared window "
          "(zero-copy all-reduce; across nodes the hierarchical path); 0: private memory"),
    _flag("overlap", None, "start each gradient bucket's all-reduce during backward (1) or all in `step()` (0); "
          "auto: overlap where the node has spare cores for the communication thread"),
    _flag("cuda_aware_mpi", None, "CUDA tensors to MPI as they are (1) or staged through host memory (0); auto: ask "
          "the MPI library (`MPIX_Query_cuda_support`)"),
    Setting("backend", "choice", "mpi", "`DistributedOptimizer`'s default backend (docs/torch.md)",
            choices=("mpi", "gloo", "nccl", "horovod")),
    Setting("rendezvous_addr", "text", None, "address torch.distributed (gloo, nccl backends) rendezvouses at, "
            "e.g. a fast interface's; unset: rank 0's host name"),
    _flag("malloc_tuning", True, "raise glibc's mmap/trim thresholds unless you set them (docs/performance.md)"),
    _flag("elastic", False, "recover from a lost rank inside the job (`hpctrain.torch.elastic`): survivors "
          "re-form the world and go on; needs an MPI with the fault-tolerance extension, started with it on "
          "(`hpctrain launch --elastic` sets both)"),
    Setting("elastic_min_ranks", "count", 1, "elastic jobs end (cleanly, on every survivor) when fewer ranks "
            "than this survive", minimum=1),
    Setting("elastic_report", "text", None, "directory where each rank of an elastic job writes, as it exits or "
            "aborts, what it saw (lost ranks, where it resumed, its exit status); `hpctrain launch --elastic` "
            "sets it and reads them"),
    _flag("abort_on_exception", True, "an uncaught exception on any rank aborts the MPI job"),
    Setting("mpiexec", "text", None, "the `mpiexec` `hpctrain launch` runs; unset: the one beside this Python, "
            "else the first on PATH"),
    Setting("launch_abort_grace", "seconds", 20.0, "seconds `hpctrain launch` lets mpiexec run on after it "
            "printed that a rank called `MPI_Abort`; then it ends mpiexec and every process under it and exits "
            "with the abort's code (Open MPI 5's launcher was seen to stay, its ranks gone, when ranks on two "
            "nodes aborted at once) (0: never)", minimum=0, zero="lets mpiexec run on"),
    Setting("checkpoint_dir", "text", None, "directory whose free space `hpctrain probe` reports (the default "
            "of `--checkpoint-dir`)"),
)
_BY_NAME: Dict[str, Setting] = {s.name: s for s in DECLARED}
_cache: Dict[str, Any] = {}


def _setting(name: str) -> Setting:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise AttributeError(f"hpctrain.settings has no setting {name!r}; known: {', '.join(_BY_NAME)}") from None


# --------------------------------------------------------------------------- reading
def read(name: str, env: Mapping[str, str]) -> Any:
    """The value of setting ``name`` in ``env`` (a mapping like ``os.environ``), not cached."""
    s = _setting(name)
    return s.parse(env.get(s.env))


def get(name: str) -> Any:
    """The value of setting ``name`` from this process's environment, parsed on first use."""
    try:
        return _cache[name]
    except KeyError:
        value = _cache[name] = read(name, os.environ)
        return value


class _Settings:
    """Attribute access to the settings: ``rc.stall_timeout``; read-only (use ``override``)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        return get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"settings are read from the environment; set {PREFIX}{name.upper()} "
                             "before the process starts (or use hpctrain.settings.override in tests)")

    def __dir__(self) -> List[str]:
        return list(_BY_NAME)


rc = _Settings()


def reset() -> None:
    """Forget every parsed value: the next read parses the environment again."""
    _cache.clear()


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Within the block, settings read as ``values`` (checked like the environment's: a string
    is parsed, a typed value range-checked); the previous values come back after it."""
    parsed = {}
    for name, value in values.items():
        s = _setting(name)
        try:
            parsed[name] = s.parse(value) if isinstance(value, str) else s.check(value)
        except ValueError as exc:
            raise SettingError(f"override({name}={value!r}): expected {s.expected()}") from exc
    saved = {name: _cache[name] for name in values if name in _cache}
    _cache.update(parsed)
    try:
        yield
    finally:
        for name in values:
            _cache.pop(name, None)
        _cache.update(saved)


def check_all(env: Optional[Mapping[str, str]] = None) -> None:
    """Parse every declared variable (of ``env``, default this process's): SettingError for
    the first bad one. Called at start-up so that a bad value stops a job before it runs."""
    for s in DECLARED:
        if env is None:
            get(s.name)
        else:
            read(s.name, env)


# --------------------------------------------------------------------------- docs
def markdown_table() -> str:
    """The README's table of variables."""
    rows = ["| variable | default | accepted | meaning |", "|---|---|---|---|"]
    for s in DECLARED:
        rows.append(f"| `{s.env}` | {s.default_text()} | {s.accepted()} | {s.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
