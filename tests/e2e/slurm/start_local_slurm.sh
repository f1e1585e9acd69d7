#!/usr/bin/env bash
# Install (Debian's slurm-wlm) and start a one-node Slurm cluster on this machine for the tests:
# munged, slurmctld and slurmd on localhost, one partition holding this node. Idempotent: when
# the node already answers (its state in `sinfo -o %T` is idle, mixed, allocated or completing:
# not `idle*`, down, drained or draining), it does nothing; else it ends only once the node does,
# and names the state it saw when it gives up. Needs root (apt-get, /etc/slurm, /run).
set -euo pipefail
HOST=$(hostname -s)
node_state() { timeout 10 sinfo -h -n "$HOST" -o %T 2>/dev/null | head -n 1; }
responsive() { [[ "$1" =~ ^(idle|mixed|allocated|completing)$ ]]; }
if command -v sinfo >/dev/null 2>&1 && responsive "$(node_state)"; then
  exit 0
fi
if ! command -v slurmctld >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /etc/munge
# Addresses are given (127.0.0.1): the host name need not resolve (on some machines it does not).
cat > /tmp/rltrain-slurm.conf <<CONF
ClusterName=rltrain-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 NodeHostname=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
if ! cmp -s /tmp/rltrain-slurm.conf /etc/slurm/slurm.conf; then
  # a changed configuration: daemons started with another one must not be reused
  pkill -x slurmctld 2>/dev/null || true
  pkill -x slurmd 2>/dev/null || true
  for _ in $(seq 30); do pgrep -x 'slurmctld|slurmd' >/dev/null || break; sleep 1; done
  mv /tmp/rltrain-slurm.conf /etc/slurm/slurm.conf
fi
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown -R munge:munge /etc/munge /run/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
# A node that answers again leaves `down` by itself (ReturnToService=2); a drained one (e.g. after
# "Kill task failed") only by a resume. A trailing `*` means slurmd does not answer (yet).
STATE=""
for _ in $(seq 60); do
  STATE=$(node_state)
  if responsive "$STATE"; then
    exit 0
  fi
  case "$STATE" in
    drain*|down|fail*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 1
done
echo "local Slurm did not come up: node $HOST is '${STATE:-(no answer from sinfo)}' after 60 s" \
  "(wanted idle, mixed, allocated or completing); reason: $(timeout 10 sinfo -h -n "$HOST" -o %E 2>&1); logs:" >&2
tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
