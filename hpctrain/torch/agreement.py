"""What the ranks of a collective must agree on, and the verdict when they do not (pure).

Before a non-all-reduce collective (broadcast, allgather, alltoall, reducescatter and their
grouped forms) every rank of the set shares one small description of its call together with
the argument error it found locally, if any. Every rank then reaches the same verdict from
the same list, so one bad call raises on every rank and no rank is left inside a collective.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

__all__ = ["describe", "verdict"]


def describe(kind: str, tensors: Sequence[Any], **fields: Any) -> Tuple[Any, ...]:
    """The part of a call that must match on every rank: dtypes, the shapes that must match
    (``allgather``/``alltoall``: all but dim 0; the others: the whole shape) and ``fields``
    (root rank, reduction op, scale factors)."""
    free_dim0 = kind.endswith(("allgather", "alltoall"))
    shapes = [(t.dim(), tuple(t.shape[1:])) if free_dim0 else tuple(t.shape) for t in tensors]
    return (kind, len(tensors), tuple(str(t.dtype).replace("torch.", "") for t in tensors), tuple(shapes),
            tuple(sorted(fields.items())))


def verdict(kind: str, calls: Sequence[Tuple[Any, Optional[str]]], me: int) -> Optional[Tuple[str, str]]:
    """``calls[r]`` = (description, local error or None) of set rank r. Returns None when the
    call may proceed, else (error class, message): ``"local"`` on a rank whose own arguments
    were wrong (it re-raises its error), ``"internal"`` on the others and on a mismatch."""
    failed: List[int] = [r for r, (_, err) in enumerate(calls) if err is not None]
    if failed:
        if me in failed:
            return "local", calls[me][1] or ""
        r = failed[0]
        return "internal", (f"{kind} failed on rank {r} of the set: {calls[r][1]}\n"
                            f"HINT: fix the arguments of that rank's {kind} call; this rank's call was abandoned")
    first = calls[0][0]
    for r, (desc, _) in enumerate(calls):
        if desc != first:
            return "internal", (f"Mismatched {kind}: set rank 0 called {_show(first)}, but set rank {r} called "
                                f"{_show(desc)}.\nHINT: every rank must pass tensors of the same dtype and shape "
                                f"(dim 0 may differ for allgather/alltoall) and the same root/op/scale factors")
    return None


def _show(desc: Tuple[Any, ...]) -> str:
    kind, count, dtypes, shapes, fields = desc
    parts = [f"dtype={','.join(dtypes)}", f"shape={shapes if count != 1 else shapes[0]}"]
    parts += [f"{k}={v}" for k, v in fields]
    return f"{kind}({', '.join(parts)})"
