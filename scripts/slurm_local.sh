#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for trying and testing the suite's Slurm path
# (python -m cs336_systems.cli.sweep --executor slurm). As root:
#
#   scripts/slurm_local.sh start    # installs what is missing (apt-get), starts the daemons, waits for the node
#   scripts/slurm_local.sh status   # exit 0 when a job can be submitted
#   scripts/slurm_local.sh stop
#
# What runs: munged (as the munge user), MariaDB and slurmdbd (accounting: submitit reads job states
# with sacct, which answers nothing without it, and a cancelled or killed job would stay UNKNOWN forever;
# jobcomp/filetxt does not feed sacct, and slurmdbd is the only accounting store 22.05 has), slurmctld
# and slurmd from a one-node slurm.conf (proctrack/linuxproc, task/none: no cgroups needed).
# Everything the cluster writes is under $SLURM_LOCAL_DIR (default /var/lib/cs336-slurm).
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/var/lib/cs336-slurm}
CONF=/etc/slurm
HOST=$(hostname -s)
PACKAGES=(slurm-wlm munge mariadb-server slurmdbd)

die() { echo "slurm_local.sh: $*" >&2; exit 1; }

install() {
    local missing=()
    for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return
    command -v apt-get >/dev/null || die "needs the packages ${missing[*]} and has no apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

write_confs() {
    mkdir -p "$DIR"/{ctld,slurmd,log,mysql} "$CONF"
    local mem cpus
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
    cat >"$CONF/slurm.conf" <<EOF
ClusterName=cs336
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/slurmd
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobRequeue=1
MinJobAge=60
NodeName=$HOST CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$CONF/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$DIR/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$CONF/slurmdbd.conf"
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...
    local limit=$1 what=$2; shift 2
    for _ in $(seq "$limit"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
    die "$what did not come up within ${limit} s (logs: $DIR/log)"
}

start_munge() {
    pgrep -u munge -x munged >/dev/null && return
    mkdir -p /var/log/munge /run/munge /var/lib/munge
    chown munge:munge /var/log/munge /run/munge /var/lib/munge
    [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged
    wait_for 10 munged munge -n
}

start_db() {
    if ! mysqladmin ping >/dev/null 2>&1; then
        mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
        (mysqld_safe --user=mysql >"$DIR/log/mysqld_safe.log" 2>&1 &)
        wait_for 60 MariaDB mysqladmin ping
    fi
    mysql -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
    pgrep -x slurmdbd >/dev/null || slurmdbd
    wait_for 30 slurmdbd sacctmgr -n list cluster
    sacctmgr -i -Q add cluster cs336 >/dev/null 2>&1 || true
}

start() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (starts munged, MariaDB and the Slurm daemons)"
    install
    write_confs
    start_munge
    start_db
    pgrep -x slurmctld >/dev/null || slurmctld
    wait_for 30 slurmctld scontrol ping
    pgrep -x slurmd >/dev/null || slurmd
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
    wait_for 60 "node $HOST" bash -c "sinfo -h -N -o %t | grep -qE '^(idle|mix|alloc)'"
    echo "slurm_local.sh: one-node cluster up: $(sinfo -h -N -o '%N %t %c CPUs')"
}

status() {
    scontrol ping >/dev/null 2>&1 && sacct -n -X -S now-1minute >/dev/null 2>&1 \
        && sinfo -h -N -o %t | grep -qE '^(idle|mix|alloc)'
}

stop() {
    for d in slurmd slurmctld slurmdbd; do
        [ -f "$DIR/$d.pid" ] && kill "$(cat "$DIR/$d.pid")" 2>/dev/null || true
    done
}

case "${1:-start}" in
    start) start ;;
    status) status ;;
    stop) stop ;;
    *) die "usage: $0 start|status|stop" ;;
esac
