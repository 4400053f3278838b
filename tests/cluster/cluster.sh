#!/usr/bin/env bash
# A local multi-node test cluster on one machine: N "nodes" as Linux network namespaces.
#
#   tests/cluster/cluster.sh start [--nodes N]   create node1..nodeN (default 2); idempotent
#   tests/cluster/cluster.sh stop                remove everything `start` made
#   tests/cluster/cluster.sh status              print the nodes; exit 0 when up, 3 when down
#   tests/cluster/cluster.sh check               can this machine run it? exit 0, or print why
#
# Layout (see docs/multinode.md):
#   - a hub namespace (hpct-hub) holding a bridge br0; the root namespace is never touched;
#   - one namespace per node, node<i>, with eth0 = 10.99.0.<i>/24 whose veth peer is on br0;
#   - /etc/netns/node<i>/hosts listing every node (bind-mounted over /etc/hosts by run-on-node);
#   - tests/cluster/run-on-node NODE CMD…: nsenter the node's network namespace plus fresh
#     mount and UTS namespaces, so the command sees hostname node<i> and the node's hosts file;
#   - tests/cluster/mpi-agent: Open MPI's "ssh agent" replacement; it runs prted on a node
#     through run-on-node (select it with PRTE_MCA_plm_ssh_agent or --prtemca plm_ssh_agent).
#   - optional, `start --slurm`: munged + slurmctld (on node1) + one slurmd per node, with their
#     own SLURM_CONF under the state directory (needs the Debian slurm packages).
#
# Everything made is recorded under $HPCTRAIN_CLUSTER_DIR (default /run/hpctrain-cluster);
# `stop` removes only what is recorded there, daemons by their pid files, never by name.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE="${HPCTRAIN_CLUSTER_DIR:-/run/hpctrain-cluster}"
HUB="hpct-hub"
BRIDGE="br0"
SUBNET_PREFIX="10.99.0"
MAX_NODES=16

die() { echo "cluster.sh: $*" >&2; exit 1; }
log() { echo "cluster.sh: $*" >&2; }

usage() {
  sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

# Why this machine cannot run the cluster, or nothing when it can.
cannot_run_reason() {
  if [ "$(id -u)" != 0 ]; then echo "not root (network namespaces need root)"; return; fi
  local tool
  for tool in ip nsenter unshare mount hostname flock; do
    command -v "$tool" >/dev/null 2>&1 || { echo "'$tool' not found (Debian: iproute2, util-linux)"; return; }
  done
  local probe="hpct-probe-$$"
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "cannot create a network namespace: $err"; return
  fi
  if ! err=$(ip -n "$probe" link add hpct-pb type bridge 2>&1); then
    ip netns del "$probe" 2>/dev/null || true
    echo "cannot create a bridge inside a namespace: $err"; return
  fi
  if ! err=$(ip -n "$probe" link add hpct-pv0 type veth peer name hpct-pv1 2>&1); then
    ip netns del "$probe" 2>/dev/null || true
    echo "cannot create a veth pair inside a namespace: $err"; return
  fi
  ip netns del "$probe" 2>/dev/null || true
  if ! err=$(unshare --mount --uts -- sh -c 'hostname hpct-probe && mount --bind /etc/hostname /etc/hostname' 2>&1); then
    echo "cannot unshare mount/UTS namespaces or bind-mount: $err"; return
  fi
}

recorded_nodes() { [ -f "$STATE/nodes" ] && cat "$STATE/nodes" || true; }

ns_exists() { [ -e "/run/netns/$1" ]; }

write_hosts() {
  local n=$1 i node
  for i in $(seq 1 "$n"); do
    node="node$i"
    mkdir -p "/etc/netns/$node"
    {
      echo "127.0.0.1 localhost"
      echo "::1 localhost ip6-localhost ip6-loopback"
      for j in $(seq 1 "$n"); do echo "$SUBNET_PREFIX.$j node$j"; done
    } > "/etc/netns/$node/hosts.tmp"
    mv "/etc/netns/$node/hosts.tmp" "/etc/netns/$node/hosts"
  done
}

ensure_hub() {
  if ! ns_exists "$HUB"; then
    ip netns add "$HUB"
    echo "$HUB" >> "$STATE/namespaces"
  fi
  ip -n "$HUB" link set lo up
  ip -n "$HUB" link show "$BRIDGE" >/dev/null 2>&1 || ip -n "$HUB" link add "$BRIDGE" type bridge
  ip -n "$HUB" link set "$BRIDGE" up
}

ensure_node() {
  local i=$1 node="node$1" port="veth$1"
  if ns_exists "$node"; then
    grep -qx "$node" "$STATE/namespaces" 2>/dev/null \
      || die "a network namespace '$node' exists that this script did not create; remove it (ip netns del $node) or stop whatever made it"
  else
    ip netns add "$node"
    echo "$node" >> "$STATE/namespaces"
  fi
  ip -n "$node" link set lo up
  if ! ip -n "$node" link show eth0 >/dev/null 2>&1; then
    ip -n "$HUB" link del "$port" 2>/dev/null || true
    ip -n "$HUB" link add "$port" type veth peer name eth0 netns "$node"
  fi
  ip -n "$HUB" link set "$port" master "$BRIDGE"
  ip -n "$HUB" link set "$port" up
  ip -n "$node" addr replace "$SUBNET_PREFIX.$i/24" dev eth0
  ip -n "$node" link set eth0 up
}

kill_ns_pids() {
  local ns=$1 pids
  ns_exists "$ns" || return 0
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [ -n "$pids" ] || return 0
  # shellcheck disable=SC2086  # a list of pids, split on purpose
  kill $pids 2>/dev/null || true
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] && return 0
    sleep 0.2
  done
  # shellcheck disable=SC2086
  kill -9 $pids 2>/dev/null || true
}

remove_node() {
  local node=$1
  kill_ns_pids "$node"
  ns_exists "$node" && ip netns del "$node"
  local i=${node#node}
  ns_exists "$HUB" && ip -n "$HUB" link del "veth$i" 2>/dev/null || true
  rm -rf "/etc/netns/$node"
  if [ -f "$STATE/namespaces" ]; then
    grep -vx "$node" "$STATE/namespaces" > "$STATE/namespaces.tmp" || true
    mv "$STATE/namespaces.tmp" "$STATE/namespaces"
  fi
}

wait_forwarding() {
  # With STP off (the default) bridge ports forward at once; wait in case a kernel differs.
  local n=$1 i deadline=$((SECONDS + 10))
  for i in $(seq 1 "$n"); do
    until ip -n "$HUB" -d link show "veth$i" 2>/dev/null | grep -q "state forwarding"; do
      [ $SECONDS -lt $deadline ] || die "bridge port veth$i of node$i not forwarding after 10 s"
      sleep 0.1
    done
  done
}

do_start() {
  local n=$1
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le $MAX_NODES ] \
    || die "--nodes must be 1..$MAX_NODES, got '$n'"
  local reason
  reason=$(cannot_run_reason)
  [ -z "$reason" ] || die "cannot start the cluster: $reason"
  mkdir -p "$STATE"
  touch "$STATE/namespaces"
  if [ ! -d /etc/netns ]; then mkdir /etc/netns; touch "$STATE/made-etc-netns"; fi
  ensure_hub
  local i old
  for i in $(seq 1 "$n"); do ensure_node "$i"; done
  # Shrink: drop recorded nodes beyond N.
  for old in $(recorded_nodes); do
    [ "${old#node}" -gt "$n" ] && remove_node "$old"
  done
  seq 1 "$n" | sed 's/^/node/' > "$STATE/nodes"
  write_hosts "$n"
  wait_forwarding "$n"
  log "up: $n node(s) $(tr '\n' ' ' < "$STATE/nodes")on $SUBNET_PREFIX.0/24 (hub namespace $HUB)"
}

do_stop() {
  if [ -x "$HERE/slurm-cluster.sh" ] && [ -d "$STATE/slurm" ]; then
    "$HERE/slurm-cluster.sh" stop || log "SLURM part did not stop cleanly (see above)"
  fi
  local ns
  if [ -f "$STATE/namespaces" ]; then
    for ns in $(grep -v "^$HUB\$" "$STATE/namespaces" || true); do remove_node "$ns"; done
    if grep -qx "$HUB" "$STATE/namespaces"; then
      kill_ns_pids "$HUB"
      ns_exists "$HUB" && ip netns del "$HUB"
    fi
  fi
  if [ -f "$STATE/made-etc-netns" ]; then rmdir /etc/netns 2>/dev/null || true; fi
  rm -rf "$STATE"
  log "stopped"
}

do_status() {
  local nodes
  nodes=$(recorded_nodes)
  if [ -z "$nodes" ]; then echo "down"; return 3; fi
  local node ok=0
  for node in $nodes; do
    if ns_exists "$node" && [ -f "/etc/netns/$node/hosts" ]; then
      echo "$node ${SUBNET_PREFIX}.${node#node} up"
    else
      echo "$node ${SUBNET_PREFIX}.${node#node} MISSING"; ok=3
    fi
  done
  [ -d "$STATE/slurm" ] && echo "slurm: SLURM_CONF=$STATE/slurm/slurm.conf"
  return $ok
}

main() {
  local action=${1:-}
  [ $# -gt 0 ] && shift
  local nodes=2 slurm=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) [ $# -ge 2 ] || die "--nodes needs a value"; nodes=$2; shift 2 ;;
      --nodes=*) nodes=${1#--nodes=}; shift ;;
      --slurm) slurm=1; shift ;;
      -h|--help) usage; exit 0 ;;
      *) die "unknown option '$1' (try --help)" ;;
    esac
  done
  case "$action" in
    start|stop)
      mkdir -p "$(dirname "$STATE")"
      exec 9>"$(dirname "$STATE")/hpctrain-cluster.lock"
      flock -w 60 9 || die "another cluster.sh holds $(dirname "$STATE")/hpctrain-cluster.lock"
      if [ "$action" = start ]; then
        do_start "$nodes"
        if [ "$slurm" = 1 ]; then "$HERE/slurm-cluster.sh" start --nodes "$nodes" 9>&-; fi
      else
        do_stop 9>&-
      fi
      ;;
    status) do_status ;;
    check)
      local reason
      reason=$(cannot_run_reason)
      if [ -n "$reason" ]; then echo "$reason"; exit 2; fi
      echo "ok"
      ;;
    -h|--help|help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

main "$@"
