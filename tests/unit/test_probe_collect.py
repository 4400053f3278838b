"""Parsers of the probe with recorded inputs: CUDA_VISIBLE_DEVICES, MPI
version strings, launcher and SLURM variables; and the collectors on this (GPU-less) machine."""
from __future__ import annotations

import os

import pytest

from hpctrain.probe.collect import (collect_facts, collect_gpus, cpu_model_from_cpuinfo, detect_launcher,
                                    parse_cgroup_limit, parse_cpulist, parse_cuda_visible_devices,
                                    parse_mpi_version, parse_tasks_per_node,
                                    resolve_visible, slurm_from_env)
from hpctrain.probe.facts import GpuFacts


def gpus8():
    """8 H100s as NVML reports them (name, memory, UUID, PCI bus, compute capability)."""
    return [GpuFacts(index=i, name="NVIDIA H100 80GB HBM3", memory_total=81559 << 20, memory_free=81001 << 20,
                     uuid=f"GPU-6f4b2c1e-9d8a-4e2b-b1c3-0a1b2c3d4e{i:02d}", pci_bus_id=f"00000000:{0x18 + 16 * i:02X}:00.0",
                     compute_capability="9.0")
            for i in range(8)]


@pytest.mark.parametrize("value,tokens", [
    (None, None), ("", ()), ("-1", ()), ("NoDevFiles", ()), ("0,1", ("0", "1")), ("3, 1", ("3", "1")),
    ("0,2,-1,1", ("0", "2")), ("GPU-6f4b", ("GPU-6f4b",)), ("MIG-abc", ("MIG-abc",)), ("0,x,1", ("0",)),
])
def test_cuda_visible_devices(value, tokens):
    assert parse_cuda_visible_devices(value) == tokens


def test_resolve_visible():
    gpus = gpus8()
    assert resolve_visible(None, gpus)[0] == tuple(range(8))
    assert resolve_visible(("5", "2"), gpus)[0] == (5, 2)
    assert resolve_visible(("GPU-6f4b2c1e-9d8a-4e2b-b1c3-0a1b2c3d4e07",), gpus)[0] == (7,)
    vis, notes = resolve_visible(("9",), gpus)
    assert vis == () and "names GPU 9" in notes[0]
    vis, notes = resolve_visible(("GPU-6f4b",), gpus)  # ambiguous prefix
    assert "matches 8 GPUs" in notes[0]
    assert resolve_visible(("MIG-x",), gpus)[0] is None


@pytest.mark.parametrize("text,impl,version", [
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11", "Open MPI", "5.0.11"),
    ("Open MPI v4.1.5, package: Open MPI (HPC-X 2.15)", "Open MPI", "4.1.5"),
    ("MPICH Version:      4.1.2\nMPICH Release date: ...", "MPICH", "4.1.2"),
    ("Intel(R) MPI Library 2021.10 for Linux* OS", "Intel MPI", "2021.10"),
    ("MVAPICH2 Version      :\t2.3.7", "MVAPICH", "2.3.7"),
    ("MPI VERSION    : CRAY MPICH version 8.1.27.2 (ANL base 3.4a2)", "Cray MPICH", "8.1.27.2"),
    (None, None, None),
])
def test_mpi_versions(text, impl, version):
    assert parse_mpi_version(text) == (impl, version)


def test_launcher_detection():
    ompi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_RANK": "2", "PMIX_NAMESPACE": "prterun-vm-1234@1"}
    l = detect_launcher(ompi)
    assert (l.kind, l.env_rank, l.env_size, l.env_local_rank, l.env_local_size) == ("mpiexec", 2, 4, 0, 2)
    # mpirun inside a SLURM job: ranks inherit the daemon step's SLURM_* — still mpiexec
    assert detect_launcher(dict(ompi, SLURM_JOB_ID="7", SLURM_STEP_ID="0", SLURM_PROCID="0")).kind == "mpiexec"
    srun = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
            "SLURM_STEP_NUM_TASKS": "4", "PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.pmix.7.0",
            "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"}
    l = detect_launcher(srun)
    assert (l.kind, l.detail, l.env_rank, l.env_size, l.env_local_rank) == ("srun", "srun --mpi=pmix", 3, 4, 1)
    hydra = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "I_MPI_ROOT": "/opt"}
    l = detect_launcher(hydra)
    assert (l.kind, l.env_rank, l.env_size) == ("mpiexec", 1, 2) and "Intel" in l.detail
    assert detect_launcher({"PATH": "/bin"}).kind == "none"
    # plain sbatch script, no step: not srun
    assert detect_launcher({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}).kind == "none"


def test_slurm_from_env():
    env = {"SLURM_JOB_ID": "81234", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[001-004]",
           "SLURM_JOB_NUM_NODES": "4", "SLURM_NTASKS": "32", "SLURM_TASKS_PER_NODE": "8(x4)",
           "SLURM_CPUS_PER_TASK": "7", "SLURM_GPUS_PER_TASK": "1", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_STEP_GPUS": "1", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7",
           "SLURM_MEM_PER_NODE": "512000", "SLURM_RESTART_COUNT": "1"}
    s = slurm_from_env(env)
    assert s.in_job and s.job_id == "81234" and s.num_nodes == 4 and s.ntasks == 32
    assert s.tasks_per_node == "8(x4)" and s.cpus_per_task == 7 and s.gpus_per_task == "1"
    assert (s.procid, s.localid, s.nodeid) == (9, 1, 1) and s.step_gpus == "1" and s.mem_per_node_mb == 512000
    assert not slurm_from_env({}).in_job


def test_small_parsers():
    assert parse_tasks_per_node("4(x2),2") == [4, 4, 2]
    with pytest.raises(ValueError, match="tasks-per-node"):
        parse_tasks_per_node("4x2")
    assert parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cgroup_limit("max") is None and parse_cgroup_limit("1073741824\n") == 1 << 30
    assert parse_cgroup_limit("9223372036854771712") is None
    assert cpu_model_from_cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC 7763 64-Core Processor\n") == \
        "AMD EPYC 7763 64-Core Processor"


def test_collect_on_this_machine(tmp_path):
    """Whatever this machine is, collecting never fails; with no GPU the inventory is empty
    and says why."""
    facts = collect_facts(work_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "not" / "yet"))
    assert facts.cpus.logical >= 1 and facts.memory.total > 0
    assert facts.mpi.implementation is not None, facts.mpi
    ckpt = [d for d in facts.disks if d.role == "checkpoint"][0]
    assert ckpt.measured_at == str(tmp_path) and ckpt.free > 0
    inv = collect_gpus()
    if inv.count == 0:
        assert inv.source == "none" and inv.notes
    else:
        assert all(isinstance(g, GpuFacts) for g in inv.gpus)


def test_gpus_come_from_nvml_or_torch_never_from_nvidia_smi(tmp_path, monkeypatch):
    """nvidia-ml-py is a requirement, so NVML is always there to ask; an `nvidia-smi` on PATH
    is not run when NVML and torch.cuda find nothing."""
    from hpctrain.probe import collect

    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\necho '0, Fake GPU, GPU-x, 100, 100, 0:1:0.0, 9.0, 1'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    def no_nvml():
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(collect, "_nvml_gpus", no_nvml)
    inv = collect_gpus(env={})
    if inv.source == "torch":  # a real GPU seen by torch.cuda
        assert inv.count > 0
    else:
        assert inv.source == "none" and inv.count == 0
        assert any("NVML" in n for n in inv.notes)
    assert not (tmp_path / "ran").exists()
