#!/usr/bin/env bash
# A one-machine Slurm for trying train.sbatch (and for the test suite): controller and node daemon on loopback.
#
#   bash examples/slurm/local_cluster.sh start DIR   # installs Debian's slurmctld/slurmd/munge if missing (root)
#   SLURM_CONF=DIR/slurm.conf sbatch ...             # `start` prints the SLURM_CONF line to use
#   bash examples/slurm/local_cluster.sh stop DIR
#
# Needs root: munged and slurmd run as root here. Everything else (config, state, logs) lives under DIR.
set -euo pipefail

cmd=${1:?usage: local_cluster.sh start|stop DIR}
dir=$(mkdir -p "${2:?usage: local_cluster.sh start|stop DIR}" && cd "$2" && pwd)

stop() {
    for name in slurmd slurmctld; do
        if [[ -f "$dir/$name.pid" ]]; then kill "$(cat "$dir/$name.pid")" 2>/dev/null || true; fi
    done
    if [[ -f "$dir/munged.pid" ]]; then kill "$(cat "$dir/munged.pid")" 2>/dev/null || true; fi
    sleep 1
}

if [[ $cmd == stop ]]; then stop; exit 0; fi
[[ $cmd == start ]] || { echo "unknown command $cmd" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

# munge: a key and a daemon with its own socket under DIR
mkdir -p "$dir/munge"
chmod 700 "$dir/munge"
if [[ ! -f "$dir/munge/munge.key" ]]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
fi
socket="$dir/munge/munge.socket"
munged --force --key-file="$dir/munge/munge.key" --socket="$socket" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/seed"

host=$(hostname -s)
cpus=$(getconf _NPROCESSORS_ONLN)   # not nproc: it honours OMP_NUM_THREADS
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
mkdir -p "$dir/state" "$dir/spool"
cat > "$dir/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$(( 20000 + RANDOM % 20000 ))
SlurmdPort=$(( 40000 + RANDOM % 20000 ))
AuthType=auth/munge
AuthInfo=socket=$socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=30
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$dir/slurm.conf"

slurmctld -i
slurmd
for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
        echo "SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 1
done
echo "the local Slurm did not come up; logs:" >&2
tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
stop
exit 1
