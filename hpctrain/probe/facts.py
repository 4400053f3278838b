"""What one rank sees of its hardware and job, as plain frozen dataclasses.

Everything here is data: ``collect.py`` fills it in, ``decide.py`` makes decisions from it,
``cluster.py`` groups it by node. ``RankFacts.to_dict()`` / ``RankFacts.from_dict()`` round-trip
through JSON, so facts recorded on one machine (an 8×H100 node, say) can drive unit tests
on another.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Type, TypeVar, get_args, get_origin, get_type_hints

T = TypeVar("T")


@dataclass(frozen=True)
class GpuFacts:
    """One physical GPU (or MIG instance). ``index`` is NVML's index (PCI bus order) when
    NVML answered, else the CUDA ordinal. Memory in bytes."""

    index: int
    name: str
    memory_total: Optional[int] = None
    memory_free: Optional[int] = None
    uuid: Optional[str] = None
    pci_bus_id: Optional[str] = None
    compute_capability: Optional[str] = None  # "9.0"
    nvlinks: Optional[int] = None  # active NVLink links
    # Link to each other GPU of the node, like `nvidia-smi topo -m`: "NV18" (18 NVLinks),
    # "PIX"/"PXB" (PCIe switch), "PHB" (host bridge), "NODE" (same NUMA node), "SYS".
    links: Tuple[Tuple[int, str], ...] = ()


@dataclass(frozen=True)
class GpuInventory:
    """The GPUs of this rank's node and which of them this rank may use."""

    gpus: Tuple[GpuFacts, ...] = ()
    # Indices into ``gpus`` (by GpuFacts.index) in CUDA ordinal order for this process,
    # after CUDA_VISIBLE_DEVICES. None when the mapping is unknown.
    visible: Optional[Tuple[int, ...]] = None
    cuda_visible_devices: Optional[str] = None
    driver_version: Optional[str] = None
    cuda_driver_version: Optional[str] = None  # highest CUDA the driver supports, e.g. "12.4"
    torch_cuda_version: Optional[str] = None  # CUDA runtime torch was built with
    torch_cuda_available: bool = False
    torch_device_count: int = 0
    source: str = "none"  # "nvml", "torch" or "none"
    notes: Tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.gpus)

    def visible_gpus(self) -> Tuple[GpuFacts, ...]:
        """The GPUs this process may use, in CUDA ordinal order."""
        if self.visible is None:
            return self.gpus[: self.torch_device_count] if self.torch_device_count else self.gpus
        by_index = {g.index: g for g in self.gpus}
        return tuple(by_index[i] for i in self.visible if i in by_index)


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: Tuple[int, ...]
    memory_total: Optional[int] = None


@dataclass(frozen=True)
class CpuFacts:
    logical: int
    physical: Optional[int]
    model: Optional[str] = None
    numa: Tuple[NumaNode, ...] = ()
    affinity: Optional[Tuple[int, ...]] = None  # CPUs this process may run on
    torch_threads: Optional[int] = None
    omp_num_threads: Optional[str] = None


@dataclass(frozen=True)
class MemoryFacts:
    total: int
    available: int
    cgroup_limit: Optional[int] = None  # a container/cgroup memory limit below total


@dataclass(frozen=True)
class DiskFacts:
    role: str  # "work" or "checkpoint"
    path: str
    measured_at: str  # nearest existing directory (the path itself if it exists)
    free: Optional[int]
    total: Optional[int]
    error: Optional[str] = None


@dataclass(frozen=True)
class MpiFacts:
    library_version: Optional[str]  # first line of MPI_Get_library_version
    implementation: Optional[str]  # "Open MPI", "MPICH", "Intel MPI", "MVAPICH", …
    version: Optional[str]
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    error: Optional[str] = None


@dataclass(frozen=True)
class LauncherFacts:
    kind: str  # "mpiexec", "srun" or "none"
    detail: str = ""  # e.g. "Open MPI mpiexec", "srun --mpi=pmix"
    evidence: Tuple[str, ...] = ()  # the variables that told
    env_rank: Optional[int] = None
    env_size: Optional[int] = None
    env_local_rank: Optional[int] = None
    env_local_size: Optional[int] = None


@dataclass(frozen=True)
class SlurmFacts:
    job_id: Optional[str] = None
    step_id: Optional[str] = None
    job_name: Optional[str] = None
    partition: Optional[str] = None
    nodelist: Optional[str] = None
    num_nodes: Optional[int] = None
    ntasks: Optional[int] = None
    tasks_per_node: Optional[str] = None  # as SLURM writes it, e.g. "4(x2),2"
    cpus_per_task: Optional[int] = None
    gpus_per_task: Optional[str] = None
    gpus_per_node: Optional[str] = None
    procid: Optional[int] = None
    localid: Optional[int] = None
    nodeid: Optional[int] = None
    step_gpus: Optional[str] = None
    job_gpus: Optional[str] = None
    cpus_on_node: Optional[int] = None
    mem_per_node_mb: Optional[int] = None
    restart_count: Optional[int] = None

    @property
    def in_job(self) -> bool:
        return self.job_id is not None


@dataclass(frozen=True)
class InfinibandPort:
    device: str
    port: int
    state: Optional[str] = None  # "4: ACTIVE"
    rate: Optional[str] = None  # "200 Gb/sec (4X HDR)"
    link_layer: Optional[str] = None  # "InfiniBand" or "Ethernet" (RoCE)


@dataclass(frozen=True)
class NetInterface:
    name: str
    up: Optional[bool] = None
    speed_mbps: Optional[int] = None
    mtu: Optional[int] = None
    addresses: Tuple[str, ...] = ()


@dataclass(frozen=True)
class NetworkFacts:
    infiniband: Tuple[InfinibandPort, ...] = ()
    interfaces: Tuple[NetInterface, ...] = ()
    hints: Tuple[str, ...] = ()


@dataclass(frozen=True)
class RankFacts:
    """Everything one rank knows about itself."""

    hostname: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    pid: int
    cpus: CpuFacts
    memory: MemoryFacts
    gpus: GpuInventory
    mpi: MpiFacts
    launcher: LauncherFacts
    slurm: SlurmFacts
    network: NetworkFacts = NetworkFacts()
    disks: Tuple[DiskFacts, ...] = ()
    python: str = ""
    torch_version: str = ""
    hpctrain_version: str = ""
    notes: Tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict (tuples become lists)."""
        return _to_jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "RankFacts":
        """Rebuild from ``to_dict()`` output (unknown keys are rejected, missing optional
        ones take their defaults)."""
        return _from_dict(cls, data)


def _to_jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    return value


def _from_dict(cls: Type[T], data: Dict[str, Any]) -> T:
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}; known: {sorted(names)}")
    kwargs = {k: _convert(hints[k], v) for k, v in data.items()}
    return cls(**kwargs)


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = get_origin(hint)
    args = get_args(hint)
    if origin is None and dataclasses.is_dataclass(hint):
        return _from_dict(hint, value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v) for v in value)
        return tuple(_convert(a, v) for a, v in zip(args, value))
    if origin is list or origin is List:
        return [_convert(args[0], v) for v in value] if args else list(value)
    if args and type(None) in args:  # Optional[X]
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value)
    return value
