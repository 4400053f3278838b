"""Where this process sits in a SLURM job, read from environment variables (pure).

The MPI launcher decides which variables describe *this rank*:

- ``srun --mpi=pmix``: ``SLURM_PROCID`` / ``SLURM_LOCALID`` / ``SLURM_NODEID`` are per task.
- ``mpirun`` inside an allocation: every rank inherits the batch script's (or mpirun's
  daemon's) ``SLURM_PROCID=0`` — checked on a real slurmd — so the rank comes from Open MPI's
  ``OMPI_COMM_WORLD_*`` (or ``PMIX_RANK``) instead.

:func:`from_environ` takes the mapping as a parameter so that every rank's view can be
built and tested in one process.
"""
from __future__ import annotations

import socket

import os
from dataclasses import dataclass
from typing import List, Mapping, Optional

from .nodelist import expand_nodelist, expand_tasks_per_node

__all__ = ["SlurmEnv", "from_environ", "in_slurm_job", "master_port_for", "restart_count"]


def _int(env: Mapping[str, str], *keys: str) -> Optional[int]:
    for key in keys:
        value = env.get(key, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{key}={value!r} is not an integer") from None
    return None


def master_port_for(job_id: int) -> int:
    """A rendezvous port derived from the job id, so two jobs sharing a node differ.

    Same rule as PyTorch Lightning's SLURM environment: 10000 + the job id's last 4 digits.
    """
    return 10000 + job_id % 10000


def in_slurm_job(env: Optional[Mapping[str, str]] = None) -> bool:
    """True inside a SLURM allocation (batch script, salloc shell or job step)."""
    env = os.environ if env is None else env
    return "SLURM_JOB_ID" in env


def restart_count(env: Optional[Mapping[str, str]] = None) -> int:
    """How often SLURM has requeued this job (``SLURM_RESTART_COUNT``; 0 on the first run)."""
    env = os.environ if env is None else env
    return _int(env, "SLURM_RESTART_COUNT") or 0


@dataclass(frozen=True)
class SlurmEnv:
    """This process's place in a SLURM job. ``launcher`` says where rank/size came from."""

    job_id: int
    job_name: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    nodes: List[str]
    master_addr: str
    master_port: int
    cpus_per_task: int
    restart_count: int
    array_task_id: Optional[int]
    launcher: str  # "srun", "mpirun" or "batch" (the batch script itself, no step)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside the world size {self.size}")
        if not 0 <= self.local_rank < max(self.local_size, 1):
            raise ValueError(f"local rank {self.local_rank} is outside the local size {self.local_size}")

    @property
    def is_requeued(self) -> bool:
        """True on a rerun after ``scontrol requeue`` or preemption (resume from a checkpoint)."""
        return self.restart_count > 0


def from_environ(env: Optional[Mapping[str, str]] = None) -> Optional[SlurmEnv]:
    """The SLURM view of this process, or None outside a SLURM job.

    Raises ValueError (naming the variable) when a SLURM variable is malformed.
    """
    env = os.environ if env is None else env
    job_id = _int(env, "SLURM_JOB_ID", "SLURM_JOBID")
    if job_id is None:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    nodes = expand_nodelist(nodelist) if nodelist else [env.get("SLURMD_NODENAME", "localhost")]
    num_nodes = _int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or len(nodes)
    per_node_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    per_node = expand_tasks_per_node(per_node_text) if per_node_text else [1] * num_nodes

    if "OMPI_COMM_WORLD_RANK" in env:
        launcher = "mpirun"
        rank = _int(env, "OMPI_COMM_WORLD_RANK") or 0
        size = _int(env, "OMPI_COMM_WORLD_SIZE") or 1
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or 1
        # Not OMPI_COMM_WORLD_NODE_RANK: Open MPI sets it to the rank among the processes
        # on the node; and SLURM_NODEID describes mpirun's daemon step (0 on every node).
        # The node index is this host's place in the job's node list (found across "nodes").
        host = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
        node_rank = nodes.index(host) if host in nodes else 0
    elif "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        launcher = "srun"
        rank = _int(env, "SLURM_PROCID") or 0
        size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or 1
        local_rank = _int(env, "SLURM_LOCALID") or 0
        node_rank = _int(env, "SLURM_NODEID") or 0
        local_size = per_node[node_rank] if node_rank < len(per_node) else 1
    else:
        launcher = "batch"
        rank, size, local_rank, local_size = 0, 1, 0, 1
        node_rank = _int(env, "SLURM_NODEID") or 0

    return SlurmEnv(
        job_id=job_id,
        job_name=env.get("SLURM_JOB_NAME", ""),
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        nodes=nodes,
        master_addr=env.get("MASTER_ADDR") or nodes[0],
        master_port=_int(env, "MASTER_PORT") or master_port_for(job_id),
        cpus_per_task=_int(env, "SLURM_CPUS_PER_TASK") or 1,
        restart_count=_int(env, "SLURM_RESTART_COUNT") or 0,
        array_task_id=_int(env, "SLURM_ARRAY_TASK_ID"),
        launcher=launcher,
    )
