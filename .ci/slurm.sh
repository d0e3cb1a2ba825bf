#!/usr/bin/env bash
# A one-node Slurm cluster on loopback for tests/test_slurm.py (Debian's slurm-wlm and munge).
#   bash .ci/slurm.sh install   apt-get install slurm-wlm munge (root)
#   bash .ci/slurm.sh start     write /etc/slurm/slurm.conf, start munged, slurmctld and slurmd; wait until it answers
#   bash .ci/slurm.sh stop      stop the three daemons started by `start`
# The node is called "localhost" (address 127.0.0.1), so jobs' SLURM_NODELIST and torch.distributed's
# MASTER_ADDR stay on loopback whatever this machine's host name resolves to. No cgroups: process
# tracking by /proc (proctrack/linuxproc) and no task binding, which works inside containers.
set -euo pipefail

STATE=${SLURM_CI_STATE:-/var/lib/latentforge-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by latentforge .ci/slurm.sh"

install() {
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurm-wlm munge procps
}

write_conf() {
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        echo "$CONF exists and was not written by this script; not touching a real cluster's config" >&2
        exit 1
    fi
    mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d"
    cat >"$CONF" <<EOF
$MARK
ClusterName=latentforge-ci
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
# A requeued job waits cred_expire seconds (120 by default) before it may start again, and a
# killed one gets KillWait seconds between SIGTERM and SIGKILL: both short, so tests wait little.
AuthInfo=cred_expire=5
KillWait=10
# Preemption as clusters set it up: a job of the higher-tier partition "urgent" that needs the CPUs a "debug" job
# holds preempts it; Slurm sends that job SIGTERM, ends it GraceTime + KillWait later at the latest, and requeues it.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=localhost NodeAddr=127.0.0.1 NodeHostname=localhost CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=20
PartitionName=urgent Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
}

start() {
    write_conf
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create
    pgrep -x munged >/dev/null || runuser -u munge -- munged
    pgrep -x slurmctld >/dev/null || slurmctld -c    # -c: forget jobs of an earlier start
    pgrep -x slurmd >/dev/null || slurmd -N localhost
    for _ in $(seq 60); do
        if sinfo -h -o %T 2>/dev/null | grep -qx idle; then
            echo "slurm: node localhost idle"
            return 0
        fi
        sleep 1
    done
    echo "slurm did not come up; logs in $STATE" >&2
    tail -n 20 "$STATE"/*.log >&2 || true
    return 1
}

stop() {
    local pids=()
    for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid" /run/munge/munged.pid; do
        if [ -s "$pidfile" ]; then pids+=("$(cat "$pidfile")"); fi
    done
    [ ${#pids[@]} -eq 0 ] && return 0
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 30); do   # the daemons save their state before they exit
        kill -0 "${pids[@]}" 2>/dev/null || return 0
        sleep 0.5
    done
    echo "slurm daemons still running: ${pids[*]}" >&2
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
