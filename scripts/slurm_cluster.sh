#!/usr/bin/env bash
# A one-host SLURM cluster in a directory of its own, for make slurm-test.
#
#   scripts/slurm_cluster.sh start DIR   # munged + slurmctld + slurmd, config in DIR
#   scripts/slurm_cluster.sh stop DIR    # stops the daemons started in DIR
#   scripts/slurm_cluster.sh check       # exit 0 when the cluster can be started here
#
# After start, `export SLURM_CONF=DIR/slurm.conf` points sbatch, srun, scontrol and
# scancel at it. A requeued job starts again after AuthInfo's cred_expire + 1 s and a
# scheduler pass: SLURM_CRED_EXPIRE (default 10 here, 120 in SLURM) and
# SLURM_SCHED_INTERVAL (default 2 here, 60 in SLURM) set them. Nothing outside DIR is written: munge gets its own key, socket and
# seed; slurmctld and slurmd their own ports, state and logs. The daemons run as root
# (SlurmUser=root), as on a test machine; proctrack/linuxproc and task/none need no
# cgroups. Missing packages are installed from Debian's (slurm-wlm, munge) when this
# runs as root with apt-get; otherwise `check` says what is missing.
set -euo pipefail

need=(munged slurmctld slurmd sbatch srun scontrol scancel squeue)

missing() {
    local m=()
    for t in "${need[@]}"; do command -v "$t" >/dev/null || m+=("$t"); done
    echo "${m[@]:-}"
}

install_if_missing() {
    [ -z "$(missing)" ] && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "slurm_cluster: installing slurm-wlm and munge from Debian's packages" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
    fi
    [ -z "$(missing)" ]
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
    local dir
    dir=$(realpath -m "$1")
    mkdir -p "$dir"/{state,spool,log,munge}
    chmod 700 "$dir/munge"
    # munge: a fresh key; socket, pid, seed and log in DIR.
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --seed-file="$dir/munge/munged.seed" \
        --log-file="$dir/log/munged.log"
    local host cpus mem ctld_port slurmd_port
    host=$(hostname -s)
    cpus=8  # more than the cores: jobs of the tests may overlap (config_overrides below)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
    ctld_port=$(free_port)
    slurmd_port=$(free_port)
    cat > "$dir/slurm.conf" <<CONF
ClusterName=spjax
MailProg=/bin/true
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=${SLURM_CRED_EXPIRE:-10}
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=${SLURM_SCHED_INTERVAL:-2}
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
GresTypes=gpu
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
    # Eight GPUs whose device files are empty files: the batch scripts' --gpus-per-task and
    # --gpus-per-node are scheduled as on a GPU node; the tasks run on simulated CPU devices.
    mkdir -p "$dir/dev"
    for i in 0 1 2 3 4 5 6 7; do mknod "$dir/dev/gpu$i" c 1 3; done  # like /dev/null
    echo "NodeName=$host Name=gpu File=$dir/dev/gpu[0-7]" > "$dir/gres.conf"
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF"
    # Ready when the node answers idle.
    local i
    for i in $(seq 1 60); do
        if sinfo -h -o %t 2>/dev/null | grep -qx idle; then
            echo "slurm_cluster: up in $dir (SLURM_CONF=$SLURM_CONF)" >&2
            return 0
        fi
        sleep 0.5
    done
    echo "slurm_cluster: the node did not come up; logs in $dir/log" >&2
    sinfo >&2 || true
    tail -n 20 "$dir"/log/*.log >&2 || true
    return 1
}

stop() {
    local dir pidfile pid
    dir=$(realpath -m "$1")
    if [ -f "$dir/slurm.conf" ]; then
        SLURM_CONF="$dir/slurm.conf" scancel --user="$(id -un)" 2>/dev/null || true
    fi
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    done
}

case "${1:-}" in
    check)
        if install_if_missing; then exit 0; fi
        echo "slurm_cluster: missing $(missing): run as root with apt-get, or" \
             "apt-get install slurm-wlm munge" >&2
        exit 1 ;;
    start) [ $# -eq 2 ] || { echo "usage: $0 start DIR" >&2; exit 2; }
        install_if_missing || { echo "slurm_cluster: missing $(missing)" >&2; exit 1; }
        start "$2" ;;
    stop) [ $# -eq 2 ] || { echo "usage: $0 stop DIR" >&2; exit 2; }
        stop "$2" ;;
    *) echo "usage: $0 {check | start DIR | stop DIR}" >&2; exit 2 ;;
esac
