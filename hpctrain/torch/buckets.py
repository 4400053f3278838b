"""Pure planning of gradient fusion buckets (no MPI, no autograd).

A *bucket* is a flat buffer holding the gradients of several parameters back to back; one
all-reduce moves a whole bucket. The plan decides which parameter goes in which bucket, at
which offset, and in which order buckets are communicated. Every rank computes the same plan
from the same parameter list, so every rank submits the same collectives in the same order —
the invariant that keeps collectives from deadlocking (see :func:`verify_across_ranks` in
``optimizer.py``, which checks that the lists really agree).

Rules:

- Parameters are taken in *reverse registration order*: backward produces the gradients of the
  last layers first, so the first bucket fills (and can be sent) while earlier layers are still
  being differentiated.
- A bucket holds one dtype. It is closed when adding the next parameter would take it past the
  fusion threshold (bytes); a parameter larger than the threshold gets a bucket of its own, and
  a threshold of 0 gives one bucket per parameter.
- Buckets are ordered by when they become complete during backward (the position of their last
  member in reverse order), which for a single-dtype model is simply the order they were filled.
- Explicit ``groups`` (Horovod's ``groups=``): a group becomes its own bucket (split by dtype,
  never by size), so its members are always reduced together; the rest are planned by size.

The layout is what lets a parameter's ``.grad`` be a view into its bucket (offset, numel): the
buffer can come from any allocator: plain memory, or the node's shared-memory window
(``optimizer.shared_window_allocator``).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hpctrain import settings
from hpctrain.settings import parse_size as parse_bytes  # the one size rule, under its old name here

__all__ = [
    "DEFAULT_FUSION_THRESHOLD",
    "ParamSpec",
    "Slot",
    "Bucket",
    "BucketPlan",
    "plan_buckets",
    "split_into_groups",
    "fusion_threshold_from_env",
    "parse_bytes",
    "specs_digest",
    "describe_spec_mismatch",
]

# Default fusion threshold: 4 MiB, tuned on a 2-core machine (2 ranks, in-place
# MPI_Allreduce): bus bandwidth peaks around 1 MiB and falls by half at 16 MiB and by a factor
# of six at 64 MiB, and one fused 42 MB message made a training step slower than one message
# per gradient. Re-tune on yours with `hpctrain bench train --fusion-threshold`. Horovod's 64 MiB
# would therefore put every gradient of a 10M-parameter MLP in one slow message and start
# communication only after the whole backward pass. 4 MiB keeps messages in the fast band,
# still fuses the many small tensors (biases, norms) whose per-message cost is ~17 µs, and
# lets the first bucket leave while backward continues. Override: HPCTRAIN_FUSION_THRESHOLD.
DEFAULT_FUSION_THRESHOLD = 4 * 1024 * 1024

_DTYPE_SIZES = {
    "torch.float64": 8, "torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2,
    "torch.int64": 8, "torch.int32": 4, "torch.int16": 2, "torch.int8": 1, "torch.uint8": 1,
    "torch.bool": 1, "torch.complex64": 8, "torch.complex128": 16,
}


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know of one parameter: name, shape and dtype (as ``str(dtype)``)."""

    name: str
    shape: Tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_SIZES:
            raise ValueError(f"parameter {self.name!r}: unsupported dtype {self.dtype!r}; "
                             f"expected one of {sorted(_DTYPE_SIZES)}")
        if any(int(d) < 0 for d in self.shape):
            raise ValueError(f"parameter {self.name!r}: negative dimension in shape {self.shape!r}")

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(int(d) for d in self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a bucket: ``buffer[offset : offset + numel].view(shape)``."""

    index: int          # position of the parameter in the planner's input list
    name: str
    offset: int         # in elements
    numel: int
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class Bucket:
    """A flat buffer of one dtype holding the gradients of ``slots`` back to back."""

    index: int
    dtype: str
    slots: Tuple[Slot, ...]

    def __post_init__(self) -> None:
        if not self.slots:
            raise ValueError(f"bucket {self.index} is empty")
        expected = 0
        for s in self.slots:
            if s.offset != expected:
                raise ValueError(f"bucket {self.index}: slot {s.name!r} at offset {s.offset}, expected {expected}")
            expected += s.numel

    @property
    def numel(self) -> int:
        """Elements in the flat buffer."""
        return sum(s.numel for s in self.slots)

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer."""
        return self.numel * _DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class BucketPlan:
    """Buckets in communication order; every input parameter appears in exactly one slot."""

    buckets: Tuple[Bucket, ...]
    threshold: int
    num_params: int
    where: Dict[int, Tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        seen: Dict[int, Tuple[int, int]] = {}
        for b, bucket in enumerate(self.buckets):
            if bucket.index != b:
                raise ValueError(f"bucket at position {b} has index {bucket.index}")
            for s, slot in enumerate(bucket.slots):
                if slot.index in seen:
                    raise ValueError(f"parameter {slot.name!r} planned twice")
                seen[slot.index] = (b, s)
        if sorted(seen) != list(range(self.num_params)):
            missing = sorted(set(range(self.num_params)) - set(seen))
            raise ValueError(f"parameters {missing} are in no bucket")
        self.where.clear()
        self.where.update(seen)

    def locate(self, param_index: int) -> Tuple[int, int]:
        """``(bucket index, slot index)`` of the parameter at ``param_index``."""
        return self.where[param_index]


def fusion_threshold_from_env(env: Optional[Mapping[str, str]] = None) -> int:
    """The fusion threshold in bytes: ``HPCTRAIN_FUSION_THRESHOLD`` (of ``env``, default this
    process's environment) or the default (4 MiB)."""
    return settings.rc.fusion_threshold if env is None else settings.read("fusion_threshold", env)


def split_into_groups(n: int, num_groups: int) -> List[range]:
    """Split ``range(n)`` into ``num_groups`` contiguous runs whose lengths differ by at most one
    (the first ``n % num_groups`` runs get the extra element), like Horovod's ``split_list``."""
    if num_groups <= 0:
        raise ValueError(f"groups={num_groups}: expected a positive number of groups")
    q, r = divmod(n, num_groups)
    out, start = [], 0
    for g in range(num_groups):
        length = q + (1 if g < r else 0)
        out.append(range(start, start + length))
        start += length
    return [g for g in out if len(g)]


def plan_buckets(
    specs: Sequence[ParamSpec],
    threshold: int,
    groups: Optional[Sequence[Sequence[int]]] = None,
) -> BucketPlan:
    """Plan fusion buckets for ``specs`` (given in registration order).

    ``threshold``: bucket size limit in bytes (0: one parameter per bucket).
    ``groups``: optional lists of indices into ``specs``; each list is reduced as one unit.
    """
    if threshold < 0:
        raise ValueError(f"fusion threshold {threshold} < 0; expected bytes >= 0 (0 disables fusion)")
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"parameter names must be unique; duplicates: {dupes}")
    n = len(specs)
    # Position in reverse registration order: the order gradients become ready in backward.
    order = list(range(n - 1, -1, -1))
    pos = {i: p for p, i in enumerate(order)}

    units: List[Tuple[int, str, List[int]]] = []  # (ready position, dtype, indices in fill order)

    grouped: set = set()
    for g, members in enumerate(groups or ()):
        members = list(members)
        bad = [m for m in members if not 0 <= m < n]
        if bad:
            raise ValueError(f"group {g} names parameter indices {bad} outside 0..{n - 1}")
        again = [m for m in members if m in grouped]
        if again:
            raise ValueError(f"parameters {[specs[m].name for m in again]} appear in more than one group")
        grouped.update(members)
        by_dtype: Dict[str, List[int]] = {}
        for m in sorted(members, key=pos.__getitem__):
            by_dtype.setdefault(specs[m].dtype, []).append(m)
        for dtype, idx in by_dtype.items():
            units.append((max(pos[i] for i in idx), dtype, idx))

    open_: Dict[str, Tuple[List[int], int]] = {}
    for i in order:
        if i in grouped:
            continue
        spec = specs[i]
        idx, size = open_.get(spec.dtype, ([], 0))
        if idx and (threshold == 0 or size + spec.nbytes > threshold):
            units.append((pos[idx[-1]], spec.dtype, idx))
            idx, size = [], 0
        idx.append(i)
        open_[spec.dtype] = (idx, size + spec.nbytes)
    for dtype, (idx, _) in open_.items():
        if idx:
            units.append((pos[idx[-1]], dtype, idx))

    # Stable sort on ready position: deterministic, identical on every rank.
    units.sort(key=lambda u: (u[0], u[1]))
    buckets = []
    for b, (_, dtype, idx) in enumerate(units):
        slots, offset = [], 0
        for i in idx:
            s = specs[i]
            slots.append(Slot(index=i, name=s.name, offset=offset, numel=s.numel, shape=tuple(s.shape)))
            offset += s.numel
        buckets.append(Bucket(index=b, dtype=dtype, slots=tuple(slots)))
    return BucketPlan(buckets=tuple(buckets), threshold=threshold, num_params=n)


def specs_digest(specs: Sequence[ParamSpec]) -> str:
    """A short hash of names, shapes and dtypes, equal on two ranks iff their lists agree."""
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}\0{tuple(s.shape)}\0{s.dtype}\n".encode())
    return h.hexdigest()[:16]


def describe_spec_mismatch(per_rank: Sequence[Sequence[ParamSpec]]) -> Optional[str]:
    """None when every rank has the same list; otherwise a message naming the first difference."""
    ref = list(per_rank[0])
    for r, specs in enumerate(per_rank[1:], start=1):
        specs = list(specs)
        if specs == ref:
            continue
        if len(specs) != len(ref):
            return (f"rank 0 has {len(ref)} parameters to all-reduce but rank {r} has {len(specs)}")
        for i, (a, b) in enumerate(zip(ref, specs)):
            if a != b:
                return (f"parameter #{i} differs: rank 0 has {a.name!r} shape {tuple(a.shape)} {a.dtype}, "
                        f"rank {r} has {b.name!r} shape {tuple(b.shape)} {b.dtype}")
    return None
