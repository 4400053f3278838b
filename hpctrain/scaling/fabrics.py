"""Link parameters of the α-β cost model, by name or by number.

A :class:`Link` is what one message on one path costs: ``alpha_s`` (seconds per message,
whatever the size: software, injection and wire latency together) and ``bandwidth_Bps``
(bytes per second one sender can push through it). A message of ``b`` bytes costs
``alpha_s + b / bandwidth_Bps``.

The named fabrics are typical values, not measurements of any one cluster: the bandwidth is
the line rate times the share an MPI point-to-point stream reaches on it (``efficiency``), the
latency the small-message MPI ping-pong half round trip such fabrics show in the OSU
micro-benchmarks (InfiniBand ~1 µs, RoCE a few µs, kernel TCP over Ethernet tens of µs).
Calibrate on the real fabric (``hpctrain bench calibrate`` on two nodes) when you can.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Mapping, Union

__all__ = ["Link", "Fabric", "FABRICS", "link_from_spec", "parse_link_text"]


@dataclass(frozen=True)
class Link:
    """One path's cost: ``alpha_s`` per message plus ``bytes / bandwidth_Bps``."""

    alpha_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        if not self.alpha_s >= 0:
            raise ValueError(f"link latency must be >= 0 s, got {self.alpha_s!r}")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth_Bps!r}")

    def time(self, nbytes: float, messages: int = 1) -> float:
        """Seconds to send ``nbytes`` as ``messages`` messages, one after another."""
        return messages * self.alpha_s + nbytes / self.bandwidth_Bps

    def shared(self, ways: int) -> "Link":
        """This link when ``ways`` senders stream through it at once (each gets a share)."""
        return Link(self.alpha_s, self.bandwidth_Bps / max(1, ways))

    def to_dict(self) -> Dict[str, float]:
        return {"alpha_s": self.alpha_s, "bandwidth_Bps": self.bandwidth_Bps}


@dataclass(frozen=True)
class Fabric:
    """A named fabric: its description, line rate (bit/s), streamed share and latency."""

    description: str
    line_rate_bps: float
    efficiency: float
    alpha_s: float

    @property
    def link(self) -> Link:
        return Link(self.alpha_s, self.line_rate_bps / 8 * self.efficiency)


# Efficiencies: an MPI stream reaches ~90-95% of the line rate over RDMA (InfiniBand,
# RoCE) and ~80-90% over kernel TCP (header overhead, copies). Latencies: OSU osu_latency
# small-message figures typical of each kind (ConnectX-class adapters for RDMA).
FABRICS: Dict[str, Fabric] = {
    "eth10": Fabric("10 Gbit/s Ethernet, TCP", 10e9, 0.85, 30e-6),
    "eth25": Fabric("25 Gbit/s Ethernet, TCP", 25e9, 0.85, 25e-6),
    "eth100": Fabric("100 Gbit/s Ethernet, TCP", 100e9, 0.80, 20e-6),
    "roce25": Fabric("25 Gbit/s RoCE (RDMA over Ethernet)", 25e9, 0.92, 3e-6),
    "roce100": Fabric("100 Gbit/s RoCE", 100e9, 0.92, 2.5e-6),
    "roce200": Fabric("200 Gbit/s RoCE", 200e9, 0.92, 2.5e-6),
    "ib-edr": Fabric("InfiniBand EDR, 100 Gbit/s", 100e9, 0.95, 1.0e-6),
    "ib-hdr": Fabric("InfiniBand HDR, 200 Gbit/s", 200e9, 0.95, 1.0e-6),
    "ib-ndr": Fabric("InfiniBand NDR, 400 Gbit/s", 400e9, 0.95, 1.0e-6),
}

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_link_text(text: str) -> Link:
    """``"2us,12.5GB/s"`` or ``"25us,25Gbit/s"`` (latency, bandwidth) as a :class:`Link`."""
    parts = [p.strip() for p in text.split(",")]
    hint = "HINT: give latency and bandwidth, e.g. '2us,12.5GB/s' or '25us,25Gbit/s'"
    if len(parts) != 2:
        raise ValueError(f"link {text!r}: expected 'LATENCY,BANDWIDTH'. {hint}")
    lat = re.fullmatch(r"([0-9.eE+-]+)\s*(s|ms|us|µs|ns)", parts[0])
    bw = re.fullmatch(r"([0-9.eE+-]+)\s*([kKmMgG]?)(bit/s|B/s)", parts[1])
    if not lat or not bw:
        raise ValueError(f"link {text!r}: cannot read {parts[0]!r} / {parts[1]!r}. {hint}")
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[bw.group(2).lower()]
    per = 1 / 8 if bw.group(3) == "bit/s" else 1.0
    return Link(float(lat.group(1)) * _UNITS[lat.group(2)], float(bw.group(1)) * scale * per)


def link_from_spec(spec: Union[str, Mapping[str, object], Link]) -> Link:
    """A :class:`Link` from a fabric name (``"roce25"``), ``"LATENCY,BANDWIDTH"`` text, a
    mapping ``{"fabric": NAME}`` or ``{"alpha_s": …, "bandwidth_Bps": …}``, or a Link."""
    if isinstance(spec, Link):
        return spec
    if isinstance(spec, str):
        if spec in FABRICS:
            return FABRICS[spec].link
        if "," in spec:
            return parse_link_text(spec)
        raise ValueError(f"unknown fabric {spec!r}; valid: {', '.join(FABRICS)}. "
                         "HINT: or give numbers, e.g. '2us,12.5GB/s'")
    if "fabric" in spec:
        return link_from_spec(str(spec["fabric"]))
    try:
        return Link(float(spec["alpha_s"]), float(spec["bandwidth_Bps"]))  # type: ignore[arg-type]
    except KeyError as exc:
        raise ValueError(f"link {dict(spec)!r} lacks {exc.args[0]!r}. HINT: give "
                         "{'alpha_s': SECONDS, 'bandwidth_Bps': BYTES_PER_S} or {'fabric': NAME}") from None
