"""Pure parsers for SLURM's compressed host lists and per-node task counts.

``SLURM_JOB_NODELIST`` uses Slurm's hostlist syntax: comma-separated host patterns, each
with any number of bracket groups of numbers and ranges, expanded as a cartesian product in
the order ``scontrol show hostnames`` prints them (the last group varies fastest)::

    node[001-004,010]       -> node001 node002 node003 node004 node010
    gpu-a[1-2],gpu-b7       -> gpu-a1 gpu-a2 gpu-b7
    rack[1-2]-node[01-02]   -> rack1-node01 rack1-node02 rack2-node01 rack2-node02

A range keeps the zero padding of its lower bound (``[08-10]`` -> 08 09 10, ``[8-10]`` ->
8 9 10), as Slurm does. ``SLURM_TASKS_PER_NODE`` uses ``2(x3),1`` for "2,2,2,1".
"""
from __future__ import annotations

import itertools
import re
from typing import List

__all__ = ["expand_nodelist", "first_node", "expand_tasks_per_node"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
# A hostlist this long is a bug upstream, not a cluster (the largest machines have ~1e5 nodes).
_MAX_HOSTS = 1_000_000


def _split_top_level(text: str) -> List[str]:
    """Split on commas that are not inside brackets; check the brackets balance."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise ValueError(f"nested '[' at position {i} in hostlist {text!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"unmatched ']' at position {i} in hostlist {text!r}")
            depth = 0
        elif ch == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in hostlist {text!r}")
    parts.append(text[start:])
    return parts


def _expand_group(group: str, whole: str) -> List[str]:
    values: List[str] = []
    for item in group.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(
                f"bad range {item!r} in hostlist {whole!r}; expected numbers like 1-4 or 007 "
                "inside [...], separated by commas"
            )
        lo_text, hi_text = m.group(1), m.group(2)
        if hi_text is None:
            values.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ValueError(f"range {item!r} in hostlist {whole!r} runs backwards ({lo} > {hi})")
        if hi - lo >= _MAX_HOSTS:
            raise ValueError(f"range {item!r} in hostlist {whole!r} has more than {_MAX_HOSTS} hosts")
        width = len(lo_text)
        values.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return values


def _loop_order(groups: int) -> List[int]:
    """Slurm's nesting of bracket groups, outermost first.

    Slurm splits a name at its last bracket group (the fastest-varying one) and expands the
    rest recursively from the last group backwards, so ``r[1-2]n[1-2]g[0-1]`` gives
    r1n1g0 r1n1g1 r2n1g0 r2n1g1 r1n2g0 … (checked against ``scontrol show hostnames``).
    """
    if groups <= 1:
        return list(range(groups))
    return list(range(groups - 2, -1, -1)) + [groups - 1]


def _expand_pattern(pattern: str, whole: str) -> List[str]:
    # re.split with a capturing group alternates: literal, [group], literal, [group], ...
    pieces = re.split(r"\[([^\]]*)\]", pattern)
    literals, groups = pieces[0::2], pieces[1::2]
    values = []
    total = 1
    for group in groups:
        if not group:
            raise ValueError(f"empty [] in hostlist {whole!r}")
        values.append(_expand_group(group, whole))
        total *= len(values[-1])
        if total > _MAX_HOSTS:
            raise ValueError(f"hostlist {whole!r} expands to more than {_MAX_HOSTS} hosts")
    order = _loop_order(len(groups))
    names = []
    for combo in itertools.product(*(values[i] for i in order)):
        chosen = dict(zip(order, combo))
        names.append("".join(lit + (chosen[i] if i < len(groups) else "") for i, lit in enumerate(literals)))
    return names


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand a Slurm hostlist expression into host names, in Slurm's order.

    Raises ValueError (naming the expression and the problem) for unbalanced or nested
    brackets, empty patterns, non-numeric or backwards ranges.
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("empty hostlist; expected something like node[001-004] (SLURM_JOB_NODELIST)")
    if any(c.isspace() for c in text):
        raise ValueError(f"hostlist {nodelist!r} contains whitespace; Slurm hostlists never do")
    hosts: List[str] = []
    for part in _split_top_level(text):
        if not part:
            raise ValueError(f"empty host name in hostlist {nodelist!r} (stray comma?)")
        if part.startswith("["):
            raise ValueError(f"host pattern {part!r} in hostlist {nodelist!r} has no name before '['")
        hosts.extend(_expand_pattern(part, nodelist))
    return hosts


def first_node(nodelist: str) -> str:
    """The first host of a hostlist: the usual rendezvous (master) address of a job."""
    return expand_nodelist(nodelist)[0]


def expand_tasks_per_node(value: str) -> List[int]:
    """``SLURM_TASKS_PER_NODE`` (e.g. ``2(x3),1``) as one count per node: [2, 2, 2, 1]."""
    counts: List[int] = []
    for item in value.strip().split(","):
        m = _TASKS.match(item.strip())
        if not m:
            raise ValueError(
                f"bad SLURM_TASKS_PER_NODE item {item!r} in {value!r}; expected N or N(xM)"
            )
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
