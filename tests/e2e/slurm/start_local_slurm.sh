#!/usr/bin/env bash
# Install (Debian's slurm-wlm) and start a local Slurm cluster on this machine for the tests.
#
#   start_local_slurm.sh        one node: munged, slurmctld and slurmd on localhost, one partition
#                               holding this node (/etc/slurm/slurm.conf, Slurm's default ports)
#   start_local_slurm.sh N      N nodes HOST-1 .. HOST-N, each a slurmd of its own on this machine
#                               (slurmd -N; Slurm's ports + 100, configuration and state under
#                               /var/lib/rltrain-slurm-N: use it with SLURM_CONF=that/slurm.conf)
#
# Each node declares all of the machine's CPUs (the nodes of a multi-node cluster share them) and
# its share of the memory. Idempotent: when every node already answers (its state in `sinfo -o %T`
# is idle, mixed, allocated or completing: not `idle*`, down, drained or draining), it does nothing;
# else it ends only once they do, and names the states it saw when it gives up. Needs root (apt-get,
# /etc/slurm, /run).
set -euo pipefail
NODES=${1:-1}
HOST=$(hostname -s)
if [ "$NODES" -eq 1 ]; then
  NAMES=("$HOST")
  CONF=/etc/slurm/slurm.conf
  CLUSTER=rltrain-local
  CTLD_PORT=""
  STATE_DIR=/var/spool/slurmctld
  SPOOL_DIR=/var/spool/slurmd
  PID_DIR=/run
  LOG_DIR=/var/log/slurm
else
  NAMES=()
  for i in $(seq "$NODES"); do NAMES+=("$HOST-$i"); done
  BASE=/var/lib/rltrain-slurm-$NODES
  CONF=$BASE/slurm.conf
  CLUSTER=rltrain-local-$NODES
  CTLD_PORT=6917
  STATE_DIR=$BASE/slurmctld
  SPOOL_DIR=$BASE/slurmd-%n
  PID_DIR=$BASE
  LOG_DIR=$BASE/log
fi
export SLURM_CONF=$CONF
node_states() { timeout 10 sinfo -h -N -o %T 2>/dev/null || true; }
# every node answers: NODES lines, each of them idle, mixed, allocated or completing
all_responsive() {
  local states
  states=$(node_states)
  [ "$(grep -cxE 'idle|mixed|allocated|completing' <<<"$states")" -eq "$NODES" ]
}
if command -v sinfo >/dev/null 2>&1 && [ -f "$CONF" ] && all_responsive; then
  exit 0
fi
if ! command -v slurmctld >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi
CPUS=$(nproc)
MEM_MB=$(( ($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024) / NODES ))
mkdir -p "$(dirname "$CONF")" "$STATE_DIR" "$LOG_DIR" /run/munge /etc/munge
for name in "${NAMES[@]}"; do mkdir -p "${SPOOL_DIR//%n/$name}"; done
# Addresses are given (127.0.0.1): the host name need not resolve (on some machines it does not).
{
  echo "ClusterName=$CLUSTER"
  echo "SlurmctldHost=$HOST(127.0.0.1)"
  [ -z "$CTLD_PORT" ] || echo "SlurmctldPort=$CTLD_PORT"
  cat <<CONF
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=$PID_DIR/slurmctld.pid
SlurmdPidFile=$PID_DIR/slurmd${CTLD_PORT:+-%n}.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd${CTLD_PORT:+-%n}.log
CONF
  for i in "${!NAMES[@]}"; do
    # one node: slurmd's default port; several: one port each
    echo "NodeName=${NAMES[$i]} NodeAddr=127.0.0.1 NodeHostname=$HOST${CTLD_PORT:+ Port=$(( CTLD_PORT + 1 + i ))}" \
      "CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
  done
  echo "PartitionName=local Nodes=$(IFS=,; echo "${NAMES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
} > "$CONF.new"
# This cluster's daemons, by their pid files (another local cluster's are left alone).
CTLD_PID=$PID_DIR/slurmctld.pid
slurmd_pid() { if [ "$NODES" -eq 1 ]; then echo "$PID_DIR/slurmd.pid"; else echo "$PID_DIR/slurmd-$1.pid"; fi; }
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if cmp -s "$CONF.new" "$CONF"; then
  rm "$CONF.new"
else
  # a changed configuration: daemons started with another one must not be reused
  for pid_file in "$CTLD_PID" $(for name in "${NAMES[@]}"; do slurmd_pid "$name"; done); do
    ! running "$pid_file" || kill "$(cat "$pid_file")" 2>/dev/null || true
    for _ in $(seq 30); do running "$pid_file" || break; sleep 1; done
  done
  mv "$CONF.new" "$CONF"
fi
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown -R munge:munge /etc/munge /run/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force
running "$CTLD_PID" || slurmctld -f "$CONF"
for name in "${NAMES[@]}"; do
  if [ "$NODES" -eq 1 ]; then
    running "$(slurmd_pid "$name")" || slurmd -f "$CONF"
  else
    running "$(slurmd_pid "$name")" || slurmd -f "$CONF" -N "$name"
  fi
done
# A node that answers again leaves `down` by itself (ReturnToService=2); a drained one (e.g. after
# "Kill task failed") only by a resume. A trailing `*` means slurmd does not answer (yet).
for _ in $(seq 60); do
  if all_responsive; then
    exit 0
  fi
  timeout 10 sinfo -h -N -o "%N %T" 2>/dev/null | while read -r name state; do
    case "$state" in
      drain*|down|fail*) scontrol update nodename="$name" state=resume >/dev/null 2>&1 || true ;;
    esac
  done
  sleep 1
done
echo "local Slurm ($CONF) did not come up: its nodes are '$(node_states | tr '\n' ' ')' after 60 s" \
  "(wanted $NODES idle, mixed, allocated or completing); reasons: $(timeout 10 sinfo -h -N -o '%N %E' 2>&1 | tr '\n' ';'); logs:" >&2
tail -n 20 "$LOG_DIR"/*.log >&2 || true
exit 1
