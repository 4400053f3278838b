"""Pure checks of the launch environment (no MPI calls): which launcher started us, and
whether the MPI world matches the SLURM step or another launcher's process count (the
silent-singleton trap)."""
from __future__ import annotations

from typing import Mapping, Optional

from .errors import WorldSizeError

HINT_SRUN = (
    "HINT: launch MPI programs under SLURM with `srun --mpi=pmix …` or `mpirun …` inside the "
    "allocation; plain `srun` (or --mpi=pmi2 with an MPI built without it) starts independent "
    "single-rank processes that would each train alone."
)


def detect_launcher(env: Mapping[str, str]) -> str:
    """'mpiexec' (Open MPI/PRRTE, Hydra), 'srun', or 'none'."""
    if any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PRTE_LAUNCHED", "PMI_SIZE", "HYDI_CONTROL_FD", "MPI_LOCALNRANKS")):
        return "mpiexec"
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return "srun"
    return "none"


def expected_world_size(env: Mapping[str, str]) -> Optional[int]:
    """The number of ranks a direct ``srun`` launch asked for, or None when not checkable.

    Under ``mpirun`` inside an allocation, SLURM variables describe mpirun's daemons, not the
    ranks, so nothing is expected then.
    """
    if detect_launcher(env) != "srun":
        return None
    for key in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        value = env.get(key)
        if value and value.isdigit():
            return int(value)
    return None


def check_world_size(env: Mapping[str, str], mpi_size: int) -> None:
    """Raise WorldSizeError when srun started N tasks but MPI sees a world of another size."""
    expected = expected_world_size(env)
    if expected is not None and expected != mpi_size:
        raise WorldSizeError(
            f"MPI world size is {mpi_size} but SLURM started {expected} tasks "
            f"(SLURM_STEP_NUM_TASKS/SLURM_NTASKS). The MPI library did not connect to srun's "
            f"process manager.\n{HINT_SRUN}"
        )


HINT_MPI_LAUNCH = ("HINT: start the ranks with an MPI launcher: `mpirun -n N python script.py`, "
                   "`hpctrain launch -n N -- python script.py`, `horovodrun --mpi -np N …` or, under SLURM, "
                   "`srun --mpi=pmix …`")


def _int_env(env: Mapping[str, str], key: str) -> int:
    value = env.get(key, "")
    return int(value) if value.isdigit() else 0


def check_non_mpi_launcher(env: Mapping[str, str], mpi_size: int) -> None:
    """Raise WorldSizeError when a launcher that is not MPI's started several processes and
    MPI made each a world of one: horovodrun's Gloo mode (HOROVOD_SIZE) or torchrun
    (WORLD_SIZE with TORCHELASTIC_RUN_ID or MASTER_ADDR). Each process would train alone."""
    if mpi_size != 1:
        return
    if _int_env(env, "HOROVOD_SIZE") > 1:
        who, count = "horovodrun's Gloo launcher", f"HOROVOD_SIZE={env['HOROVOD_SIZE']}"
    elif _int_env(env, "WORLD_SIZE") > 1 and ("TORCHELASTIC_RUN_ID" in env or "MASTER_ADDR" in env):
        who, count = "torchrun (torch.distributed)", f"WORLD_SIZE={env['WORLD_SIZE']}"
    else:
        return
    raise WorldSizeError(
        f"this process was started by {who} ({count}), but hpctrain runs over MPI and MPI sees a world of "
        f"one process: every process would train alone.\n{HINT_MPI_LAUNCH}")
