#!/bin/bash
# A real SLURM on this one machine, for running course_lib/recipes/slurm_ddp.sbatch as a cluster would.
#
#   sudo bash tests/slurm/local-cluster.sh start [cpu|gpu8]   # install (apt) if missing, then start
#   sudo bash tests/slurm/local-cluster.sh status
#   sudo bash tests/slurm/local-cluster.sh stop               # stop exactly what `start` started; undo its edits
#
# Two nodes, n1 and n2, each served by its own slurmd on this host (ports 17001-17002), one partition `debug`:
#   cpu   each node declares this machine's cores (no GPU); tasks are bound to cores (task/affinity), as on many
#         clusters, and two jobs may share a node's cores (OverSubscribe=FORCE:2), so two jobs can run at once
#   gpu8  each node declares 32 CPUs and 8 placeholder GPUs (scheduler only: torch sees none, nothing is bound),
#         so the batch script's own #SBATCH header is satisfiable unchanged
# Debian/Ubuntu packages slurmctld, slurmd, slurm-client, munge (Slurm 22.05 on Debian 12). Needs root (the
# daemons run as root and it edits /etc); works without systemd. What it changes, and `stop` undoes:
#   /etc/slurm/slurm.conf (refuses to touch one it did not write), /etc/slurm/gres.conf (gpu8),
#   a line "127.0.0.1 n1 n2" in /etc/hosts (the batch script gives torchrun the first node's name),
#   the daemons (their pids in $STATE/pids), $STATE (spool, state, logs).
# Installed packages and munge's key stay.
set -euo pipefail
STATE=${COURSE_SLURM_STATE:-/var/tmp/course-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by the course's tests/slurm/local-cluster.sh"
HOSTS_MARK="# course-local-slurm"
NODES=(n1 n2)

die() { echo "local-cluster: $*" >&2; exit 1; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null && return
    command -v apt-get >/dev/null || die "slurmctld/slurmd/sbatch/munged missing and no apt-get: install Slurm and munge"
    # On a machine with systemd, keep the packages' own services from starting (they would find no config).
    local policy=/usr/sbin/policy-rc.d added=
    if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' > $policy && chmod +x $policy && added=1; fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null || { [ -n "$added" ] && rm -f $policy; die "apt-get failed"; }
    [ -n "$added" ] && rm -f $policy
    return 0
}

write_conf() {  # $1: cpu|gpu8
    local mode=$1 cpus mem
    mem=$(( $(awk '/MemAvailable/ {print int($2/1024)}' /proc/meminfo) * 4 / 10 ))   # MiB per node, 80% for both
    mkdir -p /etc/slurm "$STATE/ctld" "$STATE/log"
    if [ "$mode" = gpu8 ]; then cpus=32; else cpus=$(nproc); fi
    {
        echo "$MARK"
        cat <<CONF
ClusterName=course
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdSpoolDir=$STATE/%n
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# no accounting (no sacct): scontrol shows finished jobs for an hour
MinJobAge=3600
CONF
        if [ "$mode" = gpu8 ]; then
            echo "TaskPlugin=task/none"
            echo "GresTypes=gpu"
            echo "NodeName=n[1-2] NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=17001-17002 CPUs=$cpus Gres=gpu:8 RealMemory=$mem State=UNKNOWN"
            echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
        else
            echo "TaskPlugin=task/affinity"
            echo "TaskPluginParam=Cores"
            echo "NodeName=n[1-2] NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=17001-17002 CPUs=$cpus RealMemory=$mem State=UNKNOWN"
            echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2"
        fi
    } > $CONF
    if [ "$mode" = gpu8 ]; then
        # slurmd drops a GPU that has no device file: give it 8 placeholders
        mkdir -p "$STATE/fakegpu" && for i in 0 1 2 3 4 5 6 7; do touch "$STATE/fakegpu/nvidia$i"; done
        { echo "$MARK"; echo "Name=gpu File=$STATE/fakegpu/nvidia[0-7]"; } > /etc/slurm/gres.conf
    fi
}

ours() { [ -f "$1" ] && head -n 1 "$1" | grep -qxF "$MARK"; }

start_munge() {
    [ -s /etc/munge/munge.key ] || mungekey --create --force 2>/dev/null \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi   # a munged is already serving
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    setsid setpriv --reuid=munge --regid=munge --clear-groups /usr/sbin/munged -F \
        >"$STATE/log/munged.stdout" 2>&1 </dev/null &
    echo "munged=$!" >> "$STATE/pids"
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return; sleep 0.1; done
    die "munged did not start: see $STATE/log/munged.stdout"
}

start() {
    local mode=${1:-cpu}
    [ "$mode" = cpu ] || [ "$mode" = gpu8 ] || die "mode must be cpu or gpu8, not '$mode'"
    [ "$(id -u)" = 0 ] || die "run as root (sudo): the daemons run as root and it edits /etc/slurm and /etc/hosts"
    [ -f "$STATE/pids" ] && die "already started ($STATE/pids exists): run '$0 stop' first"
    if [ -e $CONF ] && ! ours $CONF; then die "$CONF exists and was not written by this script: is this a real cluster?"; fi
    install_packages
    mkdir -p "$STATE/log"
    : > "$STATE/pids"
    start_munge
    write_conf "$mode"
    # The node names must resolve: the batch script passes the first one to torchrun as the rendezvous host.
    getent hosts n1 >/dev/null || echo "127.0.0.1 ${NODES[*]}   $HOSTS_MARK" >> /etc/hosts
    cd /
    # -D: stay in the foreground (backgrounded here, so that the pid is the daemon's); -c: forget old jobs and nodes
    setsid /usr/sbin/slurmctld -D -c >"$STATE/log/slurmctld.stdout" 2>&1 </dev/null &
    echo "slurmctld=$!" >> "$STATE/pids"
    for n in "${NODES[@]}"; do
        mkdir -p "$STATE/$n"
        setsid /usr/sbin/slurmd -D -N "$n" >"$STATE/log/slurmd-$n.stdout" 2>&1 </dev/null &
        echo "slurmd_$n=$!" >> "$STATE/pids"
    done
    for _ in $(seq 300); do
        [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cx idle)" = "${#NODES[@]}" ] && { sinfo -N; return; }
        sleep 0.1
    done
    sinfo -N || true
    tail -n 5 "$STATE"/log/*.log >&2 || true
    stop
    die "the nodes did not become idle within 30 s (logs above)"
}

stop() {  # exactly the daemons `start` started, by pid (never by name); then undo the edits and check
    local name pid jobs left=""
    if [ -f "$STATE/pids" ]; then
        # jobs first: a job's processes (slurmstepd, torchrun...) outlive a killed slurmd
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            scancel $jobs 2>/dev/null || true
            for _ in $(seq 150); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
        fi
        for pass in slurm munge; do   # slurmd and slurmctld first (they talk to munged), munged last
            while IFS== read -r name pid; do
                case "$pass:$name" in slurm:munged|munge:slurm*) continue ;; esac
                kill "$pid" 2>/dev/null || continue
                for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
                kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
                echo "stopped $name ($pid)"
            done < "$STATE/pids"
        done
        while IFS== read -r name pid; do kill -0 "$pid" 2>/dev/null && left+=" $name($pid)"; done < "$STATE/pids"
    fi
    ours $CONF && rm -f $CONF
    ours /etc/slurm/gres.conf && rm -f /etc/slurm/gres.conf
    if grep -q "$HOSTS_MARK\$" /etc/hosts; then   # rewritten in place: in a container /etc/hosts is a mount
        local kept; kept=$(grep -v "$HOSTS_MARK\$" /etc/hosts); printf '%s\n' "$kept" > /etc/hosts
    fi
    [ -z "$left" ] && rm -rf "$STATE"
    # what must not outlive the cluster: its daemons, job steps, the hosts line, the config
    command -v pgrep >/dev/null && pgrep -x slurmstepd >/dev/null && left+=" slurmstepd($(pgrep -x slurmstepd | xargs))"
    grep -q "$HOSTS_MARK\$" /etc/hosts && left+=" /etc/hosts-line"
    ours $CONF && left+=" $CONF"
    [ -z "$left" ] || die "left behind:$left"
    echo "stopped: no daemon, job step, /etc/hosts line or slurm.conf of ours is left"
}

status() {
    [ -f "$STATE/pids" ] || { echo "not started"; return 1; }
    cat "$STATE/pids"
    sinfo -N
}

case ${1:-} in
    start) shift; start "$@" ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start [cpu|gpu8] | status | stop" >&2; exit 2 ;;
esac
