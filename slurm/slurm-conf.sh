# shellcheck shell=bash
# The slurm.conf of a SLURM that runs on this one machine: sourced by slurm/local-cluster.sh
# (one node) and tests/cluster/slurm-cluster.sh (several "nodes" in network namespaces), so
# that both clusters run with the same settings. Not run on its own.
#
#   slurm_conf NAME=VALUE …   prints the configuration; every name below is required except tmpfs
#     header        the first line (the writer's mark; the writers refuse to overwrite a file without it)
#     cluster       ClusterName
#     controller    SlurmctldHost, e.g. vm(127.0.0.1)
#     auth_info     AuthInfo, e.g. cred_expire=10 (add socket=… for a private munged)
#     state_dir     StateSaveLocation (slurmctld)
#     ctld_pid, ctld_log                    slurmctld's pid and log files
#     slurmd_spool, slurmd_pid, slurmd_log  slurmd's; %n (the node name) makes them per node
#     tmpfs         TmpFS (per node with %n when several slurmds share the machine)
#     nodes, addrs  NodeName and NodeAddr, e.g. node[1-3] and 10.99.0.[1-3]
#     cpus, mem_mb  CPUs and RealMemory of each node
#     partition     the one partition, the default

slurm_conf() {
  local header cluster controller auth_info state_dir ctld_pid ctld_log slurmd_spool slurmd_pid slurmd_log
  local tmpfs="" nodes addrs cpus mem_mb partition arg name
  for arg in "$@"; do
    name=${arg%%=*}
    case "$name" in
      header|cluster|controller|auth_info|state_dir|ctld_pid|ctld_log|slurmd_spool|slurmd_pid|slurmd_log|tmpfs|nodes|addrs|cpus|mem_mb|partition)
        printf -v "$name" '%s' "${arg#*=}" ;;
      *) echo "slurm_conf: unknown setting '$name'" >&2; return 2 ;;
    esac
  done
  cat <<EOF
${header:?}
ClusterName=${cluster:?}
SlurmctldHost=${controller:?}
SlurmUser=root
AuthType=auth/munge
# Fast requeue for tests: a requeued job restarts after ~12 s instead of ~150 s.
AuthInfo=${auth_info:?}
SchedulerParameters=sched_interval=2,bf_interval=1
# No systemd, no cgroups here.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Lets CPUs= exceed the real core count: more 1-CPU test jobs at once.
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
KillWait=5
# Finished jobs stay visible to 'scontrol show job' for 5 minutes (no accounting here).
MinJobAge=300
StateSaveLocation=${state_dir:?}
SlurmdSpoolDir=${slurmd_spool:?}
SlurmctldPidFile=${ctld_pid:?}
SlurmdPidFile=${slurmd_pid:?}
SlurmctldLogFile=${ctld_log:?}
SlurmdLogFile=${slurmd_log:?}
EOF
  [ -z "$tmpfs" ] || echo "TmpFS=$tmpfs"
  cat <<EOF
NodeName=${nodes:?} NodeAddr=${addrs:?} CPUs=${cpus:?} RealMemory=${mem_mb:?} State=UNKNOWN
PartitionName=${partition:?} Nodes=$nodes Default=YES MaxTime=INFINITE State=UP
EOF
}
