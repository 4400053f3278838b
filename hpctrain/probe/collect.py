"""Collect one rank's facts: GPUs (NVML, then torch.cuda), CPUs, RAM, disks, MPI, launcher,
SLURM allocation, interconnect.

Every collector tolerates absence: no GPU, no NVML library, no SLURM, no InfiniBand are
normal and end up as empty facts with a note saying why. The parsers (``parse_*``,
``detect_launcher``, ``slurm_from_env``) are pure functions of text or an environment
mapping, unit-tested with recorded inputs.
"""
from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hpctrain import settings

from .facts import (CpuFacts, DiskFacts, GpuFacts, GpuInventory, InfinibandPort, LauncherFacts, MemoryFacts,
                    MpiFacts, NetInterface, NetworkFacts, NumaNode, RankFacts, SlurmFacts)

log = logging.getLogger("hpctrain.probe")

# --------------------------------------------------------------------------- pure parsers
def parse_cpulist(text: str) -> Tuple[int, ...]:
    """'0-3,8,10-11' → (0, 1, 2, 3, 8, 10, 11)."""
    cpus: List[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            cpus.extend(range(int(a), int(b) + 1))
        else:
            cpus.append(int(part))
    return tuple(cpus)


def parse_cuda_visible_devices(value: Optional[str]) -> Optional[Tuple[str, ...]]:
    """Tokens of CUDA_VISIBLE_DEVICES; None when unset (all GPUs visible), () when it hides
    every GPU ('' or '-1' or SLURM's 'NoDevFiles'). CUDA stops at the first invalid entry
    ("0,2,-1,1" means "0,2"); so do we."""
    if value is None:
        return None
    tokens: List[str] = []
    for tok in value.split(","):
        tok = tok.strip()
        if not tok or tok == "NoDevFiles":
            break
        if re.fullmatch(r"-?\d+", tok):
            if int(tok) < 0:
                break
            tokens.append(str(int(tok)))
        elif tok.startswith(("GPU-", "MIG-")):
            tokens.append(tok)
        else:
            break
    return tuple(tokens)


def resolve_visible(tokens: Optional[Sequence[str]], gpus: Sequence[GpuFacts]) -> Tuple[Optional[Tuple[int, ...]], List[str]]:
    """Map CUDA_VISIBLE_DEVICES tokens to GpuFacts indices (NVML order), in CUDA ordinal
    order. Numbers are taken as NVML/PCI order, which CUDA uses with
    CUDA_DEVICE_ORDER=PCI_BUS_ID (and in practice on nodes of identical GPUs). Returns the
    indices (None if unknown) and notes."""
    notes: List[str] = []
    if tokens is None:
        return tuple(g.index for g in gpus), notes
    by_index = {g.index: g for g in gpus}
    out: List[int] = []
    for tok in tokens:
        if tok.isdigit():
            if int(tok) in by_index:
                out.append(int(tok))
            else:
                notes.append(f"CUDA_VISIBLE_DEVICES names GPU {tok}, but this node has GPUs {sorted(by_index)}")
                break
        elif tok.startswith("GPU-"):
            match = [g for g in gpus if g.uuid and g.uuid.startswith(tok)]
            if len(match) != 1:
                notes.append(f"CUDA_VISIBLE_DEVICES entry {tok!r} matches {len(match)} GPUs")
                break
            out.append(match[0].index)
        else:
            notes.append(f"CUDA_VISIBLE_DEVICES entry {tok!r} is a MIG instance; its memory is not the GPU's")
            return None, notes
    return tuple(out), notes


MPI_PATTERNS = (
    ("Open MPI", r"Open MPI v?([\d.]+\w*)"),
    ("Intel MPI", r"Intel\(R\) MPI Library (?:for Linux\* OS, Version )?([\d.]+(?: Update \d+)?)"),
    ("MVAPICH", r"MVAPICH2? Version\s*:?\s*([\d.]+\w*)"),
    ("Cray MPICH", r"CRAY MPICH version ([\d.]+)"),
    ("MPICH", r"MPICH Version:?\s*([\d.]+\w*)"),
    ("Microsoft MPI", r"Microsoft MPI ([\d.]+)"),
)


def parse_mpi_version(library_version: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """'Open MPI v5.0.11, package: …' → ('Open MPI', '5.0.11')."""
    if not library_version:
        return None, None
    for name, pattern in MPI_PATTERNS:
        m = re.search(pattern, library_version, re.IGNORECASE)
        if m:
            return name, m.group(1)
    return library_version.split(",")[0].strip() or None, None


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name)
        if value is not None and re.fullmatch(r"\s*\d+\s*", value):
            return int(value)
    return None


def detect_launcher(env: Mapping[str, str]) -> LauncherFacts:
    """Who started this process, from the variables launchers set.

    Open MPI's mpiexec sets OMPI_COMM_WORLD_*; MPICH/Intel MPI (Hydra) set PMI_RANK/PMI_SIZE
    and MPI_LOCALRANKID; srun sets SLURM_STEP_ID with SLURM_PROCID and, with --mpi=pmix,
    PMIX_NAMESPACE='slurm.pmix.…'. mpiexec inside a SLURM job also inherits SLURM_* (its
    daemons run as a step), so MPI launcher variables win over SLURM's.
    """
    evidence = [f"{k}={env[k]}" for k in sorted(env) if k.startswith(("OMPI_COMM_WORLD_", "PMI_", "PMIX_RANK",
                                                                       "PMIX_NAMESPACE", "MPI_LOCALRANKID",
                                                                       "SLURM_STEP_ID", "SLURM_PROCID",
                                                                       "SLURM_LOCALID", "HYDRA_"))]
    namespace = env.get("PMIX_NAMESPACE", "")
    if "OMPI_COMM_WORLD_SIZE" in env and not namespace.startswith("slurm"):
        return LauncherFacts(
            "mpiexec", "Open MPI mpiexec/mpirun", tuple(evidence),
            env_rank=_int(env, "OMPI_COMM_WORLD_RANK"), env_size=_int(env, "OMPI_COMM_WORLD_SIZE"),
            env_local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
            env_local_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        )
    slurm_step = "SLURM_STEP_ID" in env and "SLURM_PROCID" in env
    if slurm_step and (namespace.startswith("slurm") or "SLURM_LAUNCH_NODE_IPADDR" in env or "SLURM_SRUN_COMM_PORT" in env
                       or "PMI_FD" not in env and "HYDRA_CONTROL_FD" not in env and "MPI_LOCALRANKID" not in env):
        mpi = "pmix" if namespace.startswith("slurm") else ("pmi2" if "PMI_FD" in env or "PMI_SIZE" in env else "")
        return LauncherFacts(
            "srun", f"srun --mpi={mpi}" if mpi else "srun", tuple(evidence),
            env_rank=_int(env, "SLURM_PROCID"), env_size=_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
            env_local_rank=_int(env, "SLURM_LOCALID"),
            env_local_size=None,
        )
    if "PMI_SIZE" in env or "PMI_RANK" in env or "MPI_LOCALRANKID" in env:
        detail = "Intel MPI mpiexec (Hydra)" if any(k.startswith("I_MPI_") for k in env) else "MPICH mpiexec (Hydra)"
        return LauncherFacts(
            "mpiexec", detail, tuple(evidence),
            env_rank=_int(env, "PMI_RANK"), env_size=_int(env, "PMI_SIZE"),
            env_local_rank=_int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
            env_local_size=_int(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"),
        )
    if "PMIX_RANK" in env:
        return LauncherFacts("mpiexec", "a PMIx launcher (prterun/mpiexec)", tuple(evidence),
                             env_rank=_int(env, "PMIX_RANK"))
    return LauncherFacts("none", "started directly (a single process)", tuple(evidence))


def slurm_from_env(env: Mapping[str, str]) -> SlurmFacts:
    """The SLURM allocation as the job's variables describe it (empty outside a job)."""
    if "SLURM_JOB_ID" not in env and "SLURM_JOBID" not in env:
        return SlurmFacts()
    get = env.get
    return SlurmFacts(
        job_id=get("SLURM_JOB_ID") or get("SLURM_JOBID"),
        step_id=get("SLURM_STEP_ID") or get("SLURM_STEPID"),
        job_name=get("SLURM_JOB_NAME"),
        partition=get("SLURM_JOB_PARTITION"),
        nodelist=get("SLURM_JOB_NODELIST") or get("SLURM_NODELIST"),
        num_nodes=_int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
        ntasks=_int(env, "SLURM_NTASKS", "SLURM_NPROCS"),
        tasks_per_node=get("SLURM_STEP_TASKS_PER_NODE") or get("SLURM_TASKS_PER_NODE") or get("SLURM_NTASKS_PER_NODE"),
        cpus_per_task=_int(env, "SLURM_CPUS_PER_TASK"),
        gpus_per_task=get("SLURM_GPUS_PER_TASK"),
        gpus_per_node=get("SLURM_GPUS_PER_NODE") or get("SLURM_GPUS_ON_NODE"),
        procid=_int(env, "SLURM_PROCID"),
        localid=_int(env, "SLURM_LOCALID"),
        nodeid=_int(env, "SLURM_NODEID"),
        step_gpus=get("SLURM_STEP_GPUS"),
        job_gpus=get("SLURM_JOB_GPUS"),
        cpus_on_node=_int(env, "SLURM_CPUS_ON_NODE"),
        mem_per_node_mb=_int(env, "SLURM_MEM_PER_NODE"),
        restart_count=_int(env, "SLURM_RESTART_COUNT"),
    )


def parse_tasks_per_node(text: str) -> List[int]:
    """SLURM's '4(x2),2' → [4, 4, 2]."""
    out: List[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot read SLURM tasks-per-node {text!r}; expected e.g. '4(x2),2'")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def cpu_model_from_cpuinfo(text: str) -> Optional[str]:
    for key in ("model name", "Model Name", "cpu model", "Processor", "cpu"):
        m = re.search(rf"^{re.escape(key)}\s*:\s*(.+)$", text, re.MULTILINE)
        if m and m.group(1).strip():
            return m.group(1).strip()
    return None


def network_hints(ib: Sequence[InfinibandPort], interfaces: Sequence[NetInterface]) -> Tuple[str, ...]:
    """What the interconnect facts mean for MPI, in words."""
    hints: List[str] = []
    active = [p for p in ib if p.state and "ACTIVE" in p.state.upper()]
    if active:
        kinds = sorted({p.link_layer or "InfiniBand" for p in active})
        rates = sorted({p.rate for p in active if p.rate})
        hints.append(f"{len(active)} active RDMA port(s) ({', '.join(kinds)}; {', '.join(rates) or 'rate unknown'}): "
                     "MPI built with UCX/verbs uses them between nodes")
    elif ib:
        hints.append("RDMA devices present but no port is ACTIVE: MPI falls back to TCP between nodes")
    else:
        hints.append("no InfiniBand/RoCE devices: MPI uses TCP between nodes, shared memory within a node")
    fast = [i for i in interfaces if i.up and i.name != "lo" and (i.speed_mbps or 0) >= 25000]
    if fast:
        hints.append("fast Ethernet: " + ", ".join(f"{i.name} {i.speed_mbps // 1000} Gb/s" for i in fast))
    return tuple(hints)


# --------------------------------------------------------------------------- collectors
def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def collect_cpus(sys_root: str = "/sys", proc_root: str = "/proc") -> CpuFacts:
    import psutil

    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False)
    numa: List[NumaNode] = []
    node_dir = Path(sys_root) / "devices/system/node"
    for d in sorted(node_dir.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpulist = _read(d / "cpulist")
        mem = None
        meminfo = _read(d / "meminfo")
        if meminfo:
            m = re.search(r"MemTotal:\s*(\d+)\s*kB", meminfo)
            mem = int(m.group(1)) * 1024 if m else None
        numa.append(NumaNode(int(d.name[4:]), parse_cpulist(cpulist) if cpulist else (), mem))
    cpuinfo = _read(Path(proc_root) / "cpuinfo") or ""
    try:
        affinity: Optional[Tuple[int, ...]] = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        affinity = None
    torch_threads = None
    if "torch" in sys.modules:
        torch_threads = sys.modules["torch"].get_num_threads()
    return CpuFacts(logical, physical, cpu_model_from_cpuinfo(cpuinfo) or platform.processor() or None,
                    tuple(numa), affinity, torch_threads, os.environ.get("OMP_NUM_THREADS"))


def parse_cgroup_limit(text: Optional[str]) -> Optional[int]:
    """cgroup v2 ``memory.max`` / v1 ``memory.limit_in_bytes`` → bytes (None: no limit)."""
    if not text or text.strip() == "max":
        return None
    value = int(text.strip())
    return value if value < (1 << 60) else None  # v1 writes ~2^63 for "unlimited"


def collect_memory(sys_root: str = "/sys") -> MemoryFacts:
    import psutil

    vm = psutil.virtual_memory()
    limit = None
    for rel in ("fs/cgroup/memory.max", "fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = parse_cgroup_limit(_read(Path(sys_root) / rel))
        except ValueError:
            limit = None
        if limit is not None:
            break
    return MemoryFacts(int(vm.total), int(vm.available), limit if limit is not None and limit < vm.total else None)


def collect_disk(role: str, path: str) -> DiskFacts:
    """Free space where ``path`` is (or would be created: its nearest existing parent)."""
    p = Path(path).expanduser().absolute()
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
        return DiskFacts(role, str(p), str(probe), int(usage.free), int(usage.total))
    except OSError as exc:
        return DiskFacts(role, str(p), str(probe), None, None, f"{type(exc).__name__}: {exc}")


def collect_network(sys_root: str = "/sys") -> NetworkFacts:
    import psutil

    ports: List[InfinibandPort] = []
    ib_root = Path(sys_root) / "class/infiniband"
    for dev in sorted(ib_root.glob("*")):
        for port in sorted((dev / "ports").glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0):
            if not port.name.isdigit():
                continue
            ports.append(InfinibandPort(dev.name, int(port.name), _read(port / "state"), _read(port / "rate"),
                                        _read(port / "link_layer")))
    interfaces: List[NetInterface] = []
    try:
        addrs = psutil.net_if_addrs()
        stats = psutil.net_if_stats()
    except OSError:
        addrs, stats = {}, {}
    for name in sorted(addrs):
        st = stats.get(name)
        ips = tuple(a.address for a in addrs[name] if a.family in (socket.AF_INET, socket.AF_INET6))
        interfaces.append(NetInterface(name, st.isup if st else None, (st.speed or None) if st else None,
                                       st.mtu if st else None, ips))
    return NetworkFacts(tuple(ports), tuple(interfaces), network_hints(ports, interfaces))


def _nvml_gpus() -> Tuple[List[GpuFacts], Dict[str, Optional[str]], List[str]]:
    """GPUs through NVML (no CUDA context is created). Raises if NVML is unusable."""
    import pynvml

    pynvml.nvmlInit()
    try:
        info: Dict[str, Optional[str]] = {}

        def text(v) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)

        try:
            info["driver_version"] = text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            info["driver_version"] = None
        try:
            v = int(pynvml.nvmlSystemGetCudaDriverVersion())
            info["cuda_driver_version"] = f"{v // 1000}.{(v % 1000) // 10}"
        except pynvml.NVMLError:
            info["cuda_driver_version"] = None
        notes: List[str] = []
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        gpus: List[GpuFacts] = []
        for i, h in enumerate(handles):
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                total, free = int(mem.total), int(mem.free)
            except pynvml.NVMLError as exc:
                total = free = None
                notes.append(f"GPU {i}: memory unknown ({exc})")
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                cc: Optional[str] = f"{major}.{minor}"
            except pynvml.NVMLError:
                cc = None
            try:
                bus: Optional[str] = text(pynvml.nvmlDeviceGetPciInfo(h).busId)
            except pynvml.NVMLError:
                bus = None
            nvlinks = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                        nvlinks += 1
                except pynvml.NVMLError:
                    break
            gpus.append(GpuFacts(i, text(pynvml.nvmlDeviceGetName(h)), total, free, text(pynvml.nvmlDeviceGetUUID(h)),
                                 bus, cc, nvlinks))
        gpus = [_with_links(g, gpus, handles) for g in gpus]
        return gpus, info, notes
    finally:
        pynvml.nvmlShutdown()


def _with_links(gpu: GpuFacts, gpus: List[GpuFacts], handles) -> GpuFacts:
    import dataclasses

    import pynvml

    names = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}  # NVML_TOPOLOGY_*
    links: List[Tuple[int, str]] = []
    h = handles[gpu.index]
    peers_by_bus = {(g.pci_bus_id or "").lower()[-12:]: g.index for g in gpus}
    nv_to: Dict[int, int] = {}
    for link in range(gpu.nvlinks or 0):
        try:
            bus = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
            bus = (bus.decode() if isinstance(bus, bytes) else bus).lower()[-12:]
            if bus in peers_by_bus:
                nv_to[peers_by_bus[bus]] = nv_to.get(peers_by_bus[bus], 0) + 1
        except pynvml.NVMLError:
            break
    for other in gpus:
        if other.index == gpu.index:
            continue
        if nv_to.get(other.index):
            links.append((other.index, f"NV{nv_to[other.index]}"))
            continue
        try:
            level = pynvml.nvmlDeviceGetTopologyCommonAncestor(h, handles[other.index])
            links.append((other.index, names.get(int(level), str(level))))
        except pynvml.NVMLError:
            pass
    if gpu.nvlinks and not nv_to:
        # NVSwitch systems: links go to the switch, not to a peer GPU.
        links = [(o, f"NV{gpu.nvlinks}") for o, _ in links]
    return dataclasses.replace(gpu, links=tuple(links))


def _torch_gpus() -> Tuple[List[GpuFacts], List[str]]:
    import torch

    gpus: List[GpuFacts] = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = getattr(p, "uuid", None)
        gpus.append(GpuFacts(i, p.name, int(p.total_memory), None, f"GPU-{uuid}" if uuid else None, None,
                             f"{p.major}.{p.minor}"))
    return gpus, ["GPU facts from torch.cuda (free memory not read: that would create a CUDA context per GPU)"]


def collect_gpus(env: Optional[Mapping[str, str]] = None) -> GpuInventory:
    """GPUs of this node through NVML (nvidia-ml-py: the library nvidia-smi itself uses), else
    torch.cuda. Never raises: no GPU is a normal answer."""
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    tokens = parse_cuda_visible_devices(cvd)
    notes: List[str] = []
    torch_cuda_version = torch_available = None
    torch_count = 0
    try:
        import torch

        torch_cuda_version = torch.version.cuda
        torch_available = bool(torch.cuda.is_available())
        torch_count = torch.cuda.device_count() if torch_available else 0
        if not torch_cuda_version:
            notes.append(f"torch {torch.__version__} is built without CUDA")
    except Exception as exc:  # noqa: BLE001 - a broken torch must not break the probe
        notes.append(f"torch.cuda unusable: {type(exc).__name__}: {exc}")
    common = dict(cuda_visible_devices=cvd, torch_cuda_version=torch_cuda_version,
                  torch_cuda_available=bool(torch_available), torch_device_count=torch_count)
    try:
        gpus, info, nvml_notes = _nvml_gpus()
        visible, vis_notes = resolve_visible(tokens, gpus)
        return GpuInventory(tuple(gpus), visible, source="nvml", notes=tuple(notes + nvml_notes + vis_notes),
                            driver_version=info.get("driver_version"),
                            cuda_driver_version=info.get("cuda_driver_version"), **common)
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound on CPU machines, ImportError, …
        notes.append(f"NVML: {type(exc).__name__}: {exc}".strip())
    if torch_available and torch_count:
        try:
            gpus, t_notes = _torch_gpus()
            return GpuInventory(tuple(gpus), tuple(range(len(gpus))), source="torch", notes=tuple(notes + t_notes),
                                **common)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"torch.cuda: {type(exc).__name__}: {exc}")
    return GpuInventory(source="none", notes=tuple(notes), **common)


def collect_mpi(comm_module=None) -> MpiFacts:
    """MPI library and this rank's place, from hpctrain.comm (initialized or not)."""
    if comm_module is None:
        from hpctrain import comm as comm_module
    try:
        lib = comm_module.mpi_library_version().replace("\x00", "").strip()
    except Exception as exc:  # noqa: BLE001 - report, do not fail the probe
        return MpiFacts(None, None, None, error=f"{type(exc).__name__}: {exc}")
    impl, version = parse_mpi_version(lib)
    if comm_module.is_initialized():
        return MpiFacts(lib, impl, version, comm_module.rank(), comm_module.size(), comm_module.local_rank(),
                        comm_module.local_size())
    return MpiFacts(lib, impl, version)


def collect_facts(work_dir: Optional[str] = None, checkpoint_dir: Optional[str] = None,
                  env: Optional[Mapping[str, str]] = None, comm_module=None) -> RankFacts:
    """This rank's facts. Uses hpctrain.comm for rank/size when it is initialized, else the
    launcher's variables, else rank 0 of 1. ``checkpoint_dir`` defaults to
    $HPCTRAIN_CHECKPOINT_DIR (not measured when neither is set)."""
    env = dict(os.environ if env is None else env)
    import hpctrain

    if comm_module is None:
        from hpctrain import comm as comm_module
    mpi = collect_mpi(comm_module)
    launcher = detect_launcher(env)
    if comm_module.is_initialized():
        rank, size, local_rank, local_size = mpi.rank, mpi.size, mpi.local_rank, mpi.local_size
    else:  # not started: what the launcher says
        rank = launcher.env_rank if launcher.env_rank is not None else 0
        size = launcher.env_size if launcher.env_size is not None else 1
        local_rank = launcher.env_local_rank if launcher.env_local_rank is not None else 0
        local_size = launcher.env_local_size if launcher.env_local_size is not None else 1
    work = work_dir or os.getcwd()
    ckpt = checkpoint_dir or settings.read("checkpoint_dir", env)
    disks = [collect_disk("work", work)] + ([collect_disk("checkpoint", ckpt)] if ckpt else [])
    try:
        import torch

        torch_version = torch.__version__
    except Exception:  # noqa: BLE001
        torch_version = ""
    return RankFacts(
        hostname=socket.gethostname(), rank=rank, size=size, local_rank=local_rank, local_size=local_size,
        pid=os.getpid(), cpus=collect_cpus(), memory=collect_memory(), gpus=collect_gpus(env), mpi=mpi,
        launcher=launcher, slurm=slurm_from_env(env), network=collect_network(), disks=tuple(disks),
        python=platform.python_version(), torch_version=torch_version, hpctrain_version=hpctrain.__version__,
    )

