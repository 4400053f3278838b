"""hpctrain.slurm — SLURM support: where a process sits in its job, host lists, sbatch
templates, submission, and preemption (checkpoint, then requeue).

- :mod:`.env`      rank / size / local rank / node / master address from SLURM variables (pure)
- :mod:`.nodelist` ``node[001-004,010]`` -> host names (pure)
- :mod:`.render`   sbatch scripts from the templates, every value shell-quoted (pure)
- :mod:`.submit`   ``sbatch``, ``squeue``, ``scontrol`` (the only module running them)
- :mod:`.preempt`  SIGUSR1/SIGTERM -> stop at a step boundary, checkpoint, requeue

``check_world_size`` (the silent-singleton trap: plain ``srun`` starting N one-rank MPI
worlds) is ``hpctrain.comm``'s; it is re-exported here because it is a SLURM concern too.
"""
from hpctrain.comm.launcher import check_world_size, expected_world_size

from .env import SlurmEnv, from_environ, in_slurm_job, master_port_for, restart_count
from .nodelist import expand_nodelist, expand_tasks_per_node, first_node
from .preempt import PreemptionGuard, install as install_preemption_handlers, requeue_job

__all__ = [
    "SlurmEnv", "from_environ", "in_slurm_job", "master_port_for", "restart_count",
    "expand_nodelist", "expand_tasks_per_node", "first_node",
    "PreemptionGuard", "install_preemption_handlers", "requeue_job",
    "check_world_size", "expected_world_size",
]
