#!/usr/bin/env bash
# A real Slurm cluster of 3 virtual nodes (n1, n2, n3) on this one machine, for the slurm test
# tier and for trying the launchers by hand.
#   bash tools/slurm_local.sh start DIR     # installs slurm + munge if missing (apt, root)
#   export SLURM_CONF=DIR/slurm.conf        # then sbatch / srun / scontrol / sinfo work
#   bash tools/slurm_local.sh stop DIR
# Every daemon's state, logs and pid file live under DIR; stop signals the PIDs in those pid
# files and nothing else (a munged that was already running is used and left alone).
# All nodes share this host's name and 127.0.0.1: inside a task only $SLURMD_NODENAME tells
# them apart, so whatever listens on a port must pick a different port on each node.
set -euo pipefail

NODES=3
SLURMD_PORT_BASE=${SLURM_LOCAL_SLURMD_PORT_BASE:-17001}
SLURMCTLD_PORT=${SLURM_LOCAL_SLURMCTLD_PORT:-16817}
READY_TIMEOUT_S=${SLURM_LOCAL_READY_TIMEOUT_S:-60}

die() { echo "slurm_local: $*" >&2; exit 1; }

install_packages() {
    local wanted=(slurmctld slurmd slurm-client munge)
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null && return 0
    [ "$(id -u)" = 0 ] || die "slurm is not installed and installing it needs root"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh image may have no package lists yet; update only when the install needs it.
    apt-get install -y -qq --no-install-recommends "${wanted[@]}" >/dev/null 2>&1 || {
        apt-get update -qq && apt-get install -y -qq --no-install-recommends "${wanted[@]}"
    } || die "apt-get install ${wanted[*]} failed"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
    local dir=$1
    if munge -n >/dev/null 2>&1; then
        return 0  # a munged answers already (ours from an earlier start, or the system's)
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    # munged runs as the munge user, which cannot write into a root-only DIR: its files stay
    # in /run/munge.
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid \
        --log-file=/run/munge/munged.log || die "munged did not start (see /run/munge/munged.log)"
    cp /run/munge/munged.pid "$dir/munged.pid"  # ours: stop takes it down again
    for _ in $(seq 50); do
        munge -n >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged started but munge -n fails"
}

write_conf() {
    local dir=$1 host cores last_port
    host=$(hostname)
    cores=$(nproc)
    last_port=$((SLURMD_PORT_BASE + NODES - 1))
    cat >"$dir/slurm.conf" <<EOF
# Written by tools/slurm_local.sh: $NODES virtual nodes on $host.
ClusterName=mfrlocal
SlurmctldHost=$host
SlurmctldPort=$SLURMCTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
KillWait=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
NodeName=n[1-$NODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$SLURMD_PORT_BASE-$last_port] Sockets=1 CoresPerSocket=$cores ThreadsPerCore=1 RealMemory=2000 State=UNKNOWN
PartitionName=local Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_idle() {
    local dir=$1 deadline=$((SECONDS + READY_TIMEOUT_S)) idle
    while [ $SECONDS -lt $deadline ]; do
        idle=$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)
        [ "$idle" -ge "$NODES" ] && return 0
        sleep 0.5
    done
    sinfo -N >&2 || true
    die "nodes not idle after ${READY_TIMEOUT_S}s (logs in $dir/log)"
}

start() {
    local dir=$1 node
    install_packages
    mkdir -p "$dir/state" "$dir/log"
    dir=$(cd "$dir" && pwd)
    export SLURM_CONF=$dir/slurm.conf
    start_munge "$dir"
    if ! alive "$dir/slurmctld.pid"; then
        write_conf "$dir"
        # -i: ignore state left by an earlier cluster in this directory.
        slurmctld -i -f "$SLURM_CONF" || die "slurmctld failed (see $dir/log/slurmctld.log)"
    fi
    for node in $(seq 1 "$NODES"); do
        mkdir -p "$dir/spool/n$node"
        alive "$dir/slurmd-n$node.pid" \
            || slurmd -f "$SLURM_CONF" -N "n$node" || die "slurmd n$node failed"
    done
    wait_idle "$dir"
    echo "slurm_local: $NODES nodes idle; export SLURM_CONF=$SLURM_CONF"
}

stop_pid_file() {
    local file=$1 pid
    alive "$file" || { rm -f "$file"; return 0; }
    pid=$(cat "$file")
    kill -TERM "$pid"
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$file"; return 0; }
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$file"
}

stop() {
    local dir=$1 file
    [ -d "$dir" ] || return 0
    for file in "$dir"/slurmd-*.pid "$dir/slurmctld.pid" "$dir/munged.pid"; do
        [ -e "$file" ] && stop_pid_file "$file"
    done
    echo "slurm_local: stopped the daemons of $dir"
}

case "${1:-}" in
    start | stop) [ $# -eq 2 ] || die "usage: $0 start|stop DIR"; "$1" "$2" ;;
    *) die "usage: $0 start|stop DIR" ;;
esac
