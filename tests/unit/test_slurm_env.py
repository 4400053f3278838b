"""hpctrain.slurm.env: every rank's view built from its environment, in one process."""
import pytest

from hpctrain.slurm.env import from_environ, in_slurm_job, master_port_for, restart_count

JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NTASKS": "8",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_CPUS_PER_TASK": "6",
}


def srun_env(rank: int, per_node: int = 4) -> dict:
    return dict(JOB, SLURM_STEP_ID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node),
                SLURM_NODEID=str(rank // per_node), SLURM_STEP_NUM_TASKS="8",
                SLURM_STEP_TASKS_PER_NODE="4(x2)")


def test_srun_every_rank():
    views = [from_environ(srun_env(r)) for r in range(8)]
    assert [v.rank for v in views] == list(range(8))
    assert {v.size for v in views} == {8}
    assert [v.local_rank for v in views] == [0, 1, 2, 3] * 2
    assert [v.node_rank for v in views] == [0] * 4 + [1] * 4
    assert {v.local_size for v in views} == {4}
    assert {v.launcher for v in views} == {"srun"}
    v = views[5]
    assert v.nodes == ["gpu01", "gpu02"] and v.num_nodes == 2
    assert v.master_addr == "gpu01" and v.master_port == master_port_for(4242) == 14242
    assert v.cpus_per_task == 6 and v.job_name == "train" and not v.is_requeued


def test_mpirun_ranks_come_from_open_mpi_not_slurm_procid():
    """Under mpirun every rank inherits SLURM_PROCID=0 and SLURM_NODEID=0, and Open MPI's
    OMPI_COMM_WORLD_NODE_RANK is the rank *within* the node (all seen in a real 2-node job):
    the node index must come from the host's place in the node list."""
    views = []
    for r in range(8):
        env = dict(JOB, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
                   SLURMD_NODENAME=["gpu01", "gpu02"][r // 4],
                   OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="8",
                   OMPI_COMM_WORLD_LOCAL_RANK=str(r % 4), OMPI_COMM_WORLD_LOCAL_SIZE="4",
                   OMPI_COMM_WORLD_NODE_RANK=str(r % 4))
        views.append(from_environ(env))
    assert [v.rank for v in views] == list(range(8))
    assert [v.node_rank for v in views] == [0] * 4 + [1] * 4
    assert {v.launcher for v in views} == {"mpirun"}


def test_batch_script_and_outside():
    v = from_environ(dict(JOB, SLURM_RESTART_COUNT="2", SLURM_ARRAY_TASK_ID="7"))
    assert v.launcher == "batch" and (v.rank, v.size) == (0, 1)
    assert v.restart_count == 2 and v.is_requeued and v.array_task_id == 7
    assert from_environ({}) is None
    assert not in_slurm_job({}) and in_slurm_job(JOB)
    assert restart_count({}) == 0 and restart_count({"SLURM_RESTART_COUNT": "3"}) == 3


def test_master_address_override_and_single_node_fallback():
    v = from_environ(dict(JOB, MASTER_ADDR="10.0.0.1", MASTER_PORT="29400"))
    assert (v.master_addr, v.master_port) == ("10.0.0.1", 29400)
    v = from_environ({"SLURM_JOB_ID": "1", "SLURMD_NODENAME": "cn7"})
    assert v.nodes == ["cn7"] and v.master_addr == "cn7"


@pytest.mark.parametrize("key,value", [("SLURM_PROCID", "x"), ("SLURM_JOB_NODELIST", "n[1-")])
def test_malformed_variables_are_named(key, value):
    env = srun_env(0)
    env[key] = value
    with pytest.raises(ValueError, match=key if key != "SLURM_JOB_NODELIST" else "hostlist"):
        from_environ(env)


def test_rank_outside_world_is_an_error():
    env = srun_env(0)
    env["SLURM_PROCID"] = "9"
    with pytest.raises(ValueError, match="outside the world size"):
        from_environ(env)
