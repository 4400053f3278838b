"""The profile a prediction starts from: one rank's compute per step, its gradients (and when
backward produces each), and the link costs. Written by ``hpctrain bench calibrate`` or by
hand from published numbers (the JSON schema is in docs/scaling.md)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from .fabrics import Link, link_from_spec
from .model import DEFAULT_SEGMENT_BYTES

__all__ = ["Param", "Profile", "load_profile", "profile_from_dict"]

FORMAT = "hpctrain-scaling-profile"
VERSION = 1
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
# Memory-speed defaults for a profile written by hand without an intra-node level: one
# rank's copy bandwidth with its neighbours copying too, a flag round trip, numpy's a += b.
DEFAULT_INTRA = Link(5e-6, 5e9)
DEFAULT_GAMMA_BPS = 5e9


@dataclass(frozen=True)
class Param:
    """One gradient: name, shape, dtype (``float32``…) and when backward produced it
    (seconds after backward began; None: not measured)."""

    name: str
    shape: Tuple[int, ...]
    dtype: str = "float32"
    ready_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"parameter {self.name!r}: dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}")

    @property
    def numel(self) -> int:
        return math.prod(int(d) for d in self.shape)


@dataclass(frozen=True)
class Profile:
    """What :mod:`hpctrain.scaling.predict` needs; seconds, bytes and bytes/s throughout.
    ``overlap``: whether all-reduce runs during backward (False: every bucket after it, as
    ``DistributedOptimizer(overlap=False)`` does)."""

    name: str
    batch_per_rank: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    params: Tuple[Param, ...]
    intra: Link = DEFAULT_INTRA
    inter: Optional[Link] = None
    gamma_Bps: float = DEFAULT_GAMMA_BPS
    fusion_threshold: int = 4 * 1024 * 1024
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    overlap: bool = True
    measured: Dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.batch_per_rank < 1:
            raise ValueError(f"profile {self.name!r}: batch_per_rank must be >= 1, got {self.batch_per_rank}")
        for what in ("forward_s", "backward_s", "optimizer_s"):
            if not getattr(self, what) >= 0:
                raise ValueError(f"profile {self.name!r}: compute.{what} must be >= 0 s")
        if not self.params:
            raise ValueError(f"profile {self.name!r} has no parameters. HINT: give 'parameters' or 'gradients'")

    @property
    def compute_s(self) -> float:
        """One rank's step with nothing to communicate."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def gradient_bytes(self) -> int:
        return sum(p.numel * ITEMSIZE[p.dtype] for p in self.params)

    def ready_times(self) -> List[float]:
        """When backward produces each gradient (registration order). Unmeasured: backward
        gives every tensor the same time, last registered first (documented assumption)."""
        n = len(self.params)
        if all(p.ready_s is not None for p in self.params):
            return [float(p.ready_s) for p in self.params]  # type: ignore[arg-type]
        return [self.backward_s * (n - i) / n for i in range(n)]

    def to_dict(self) -> Dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "name": self.name, "batch_per_rank": self.batch_per_rank,
            "compute": {"forward_s": self.forward_s, "backward_s": self.backward_s, "optimizer_s": self.optimizer_s},
            "parameters": [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype,
                            **({"ready_s": p.ready_s} if p.ready_s is not None else {})} for p in self.params],
            "links": {"intra": self.intra.to_dict(), "gamma_Bps": self.gamma_Bps,
                      **({"inter": self.inter.to_dict()} if self.inter else {})},
            "fusion_threshold": self.fusion_threshold, "segment_bytes": self.segment_bytes,
            "overlap": self.overlap, "measured": self.measured,
        }


def _synthetic_params(spec: Mapping[str, Any]) -> Tuple[Param, ...]:
    """``{"numel": N, "tensors": K, "dtype": D}``: K equal gradients totalling N elements."""
    numel, tensors = int(spec["numel"]), int(spec.get("tensors", 1))
    if numel < 1 or tensors < 1:
        raise ValueError(f"gradients: numel and tensors must be >= 1, got {numel}, {tensors}")
    base, extra = divmod(numel, tensors)
    dtype = str(spec.get("dtype", "float32"))
    return tuple(Param(f"g{i}", (base + (1 if i < extra else 0),), dtype) for i in range(tensors))


def _params(data: Mapping[str, Any]) -> Tuple[Param, ...]:
    if "parameters" in data:
        return tuple(Param(str(p["name"]), tuple(int(d) for d in p["shape"]),
                           str(p.get("dtype", "float32")).replace("torch.", ""),
                           None if p.get("ready_s") is None else float(p["ready_s"]))
                     for p in data["parameters"])
    if "gradients" in data:
        return _synthetic_params(data["gradients"])
    raise ValueError("profile: neither 'parameters' nor 'gradients' given. HINT: see docs/scaling.md")


def profile_from_dict(data: Mapping[str, Any]) -> Profile:
    """A :class:`Profile` from its JSON form; unknown top-level keys are refused."""
    known = {"format", "version", "name", "batch_per_rank", "compute", "parameters", "gradients", "links",
             "fusion_threshold", "segment_bytes", "overlap", "measured", "source"}
    extra = sorted(set(data) - known)
    if extra:
        raise ValueError(f"profile: unknown keys {extra}; valid: {sorted(known)}")
    try:
        compute, links = data["compute"], data.get("links", {})
        return Profile(
            name=str(data.get("name", "profile")), batch_per_rank=int(data["batch_per_rank"]),
            forward_s=float(compute.get("forward_s", 0.0)), backward_s=float(compute["backward_s"]),
            optimizer_s=float(compute.get("optimizer_s", 0.0)), params=_params(data),
            intra=link_from_spec(links["intra"]) if "intra" in links else DEFAULT_INTRA,
            inter=link_from_spec(links["inter"]) if "inter" in links else None,
            gamma_Bps=float(links.get("gamma_Bps", DEFAULT_GAMMA_BPS)),
            fusion_threshold=int(data.get("fusion_threshold", 4 * 1024 * 1024)),
            segment_bytes=int(data.get("segment_bytes", DEFAULT_SEGMENT_BYTES)),
            overlap=bool(data.get("overlap", True)),
            measured=dict(data.get("measured", {})),
        )
    except KeyError as exc:
        raise ValueError(f"profile: missing key {exc.args[0]!r}. HINT: see the schema in docs/scaling.md") from None


def load_profile(path: Union[str, Path]) -> Profile:
    """Read a profile JSON file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"profile {str(path)!r} does not exist. HINT: write one with "
                         "'mpiexec -n 2 hpctrain bench calibrate CONFIG.yaml --out PROFILE.json'") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {str(path)!r} is not JSON: {exc}") from None
    return profile_from_dict(data)
