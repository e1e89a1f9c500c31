#!/usr/bin/env bash
# A one-node Slurm cluster on this machine for the sweep's Slurm path (as root): start | status | stop. munged
# (as munge), MariaDB + slurmdbd (submitit reads job states with sacct, which needs accounting: jobcomp/filetxt
# does not feed it; a cancelled job would stay UNKNOWN), slurmctld and slurmd (proctrack/linuxproc, task/none).
# State and logs under $SLURM_LOCAL_DIR. stop ends what start began ($DIR/began: munged and MariaDB too).
set -euo pipefail
DIR=${SLURM_LOCAL_DIR:-/var/lib/cs336-slurm}; RUN=${SLURM_LOCAL_RUN:-/run}; HOST=$(hostname -s)  # RUN: munged's and MariaDB's pid files
die() { echo "slurm_local.sh: $*" >&2; exit 1; }; DAEMONS="munged mysqld slurmdbd slurmctld slurmd"
pidfile() { case $1 in munged) echo "$RUN/munge/munged.pid" ;; mysqld) echo "$RUN/mysqld/mysqld.pid" ;; *) echo "$DIR/$1.pid" ;; esac; }
pid_of() { local p; p=$(cat "$(pidfile "$1")" 2>/dev/null) && ps -o stat= -p "$p" 2>/dev/null | grep -qv Z && echo "$p"; }  # a zombie has ended
wait_for() { local n=$1 what=$2; shift 2; for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done; die "$what did not come up within $n s (logs: $DIR/log)"; }
install() { local missing=(); for p in slurm-wlm munge mariadb-server slurmdbd; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return; command -v apt-get >/dev/null || die "needs ${missing[*]}; no apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; }
confs() { mkdir -p "$DIR"/{ctld,slurmd,log} /etc/slurm
    local mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
    # One setting a line (slurm.conf takes no more): the settings are written space-separated, then split.
    echo "ClusterName=cs336 SlurmctldHost=$HOST SlurmUser=root AuthType=auth/munge ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none SelectType=select/cons_tres SelectTypeParameters=CR_CPU StateSaveLocation=$DIR/ctld
        SlurmdSpoolDir=$DIR/slurmd ReturnToService=2 MinJobAge=60 JobRequeue=1 SlurmctldPidFile=$DIR/slurmctld.pid
        SlurmdPidFile=$DIR/slurmd.pid SlurmctldLogFile=$DIR/log/slurmctld.log SlurmdLogFile=$DIR/log/slurmd.log
        AccountingStorageType=accounting_storage/slurmdbd AccountingStorageHost=localhost
        JobAcctGatherType=jobacct_gather/none" | tr -s ' \n' '\n\n' >/etc/slurm/slurm.conf
    printf '%s\n' "NodeName=$HOST CPUs=$(nproc) RealMemory=$mem State=UNKNOWN" \
        "PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP" >>/etc/slurm/slurm.conf
    echo "AuthType=auth/munge DbdHost=localhost SlurmUser=root PidFile=$DIR/slurmdbd.pid LogFile=$DIR/log/slurmdbd.log
        StorageType=accounting_storage/mysql StorageHost=localhost StorageUser=slurm StoragePass=slurm
        StorageLoc=slurm_acct_db" | tr -s ' \n' '\n\n' >/etc/slurm/slurmdbd.conf && chmod 600 /etc/slurm/slurmdbd.conf; }
start() { [ "$(id -u)" -eq 0 ] || die "must run as root (starts munged, MariaDB and the Slurm daemons)"
    install; confs; mkdir -p /var/log/munge /run/munge /var/lib/munge /run/mysqld && chown munge:munge /var/log/munge /run/munge /var/lib/munge
    chown mysql:mysql /run/mysqld; [ -s /etc/munge/munge.key ] || mungekey --create
    pid_of munged >/dev/null || { runuser -u munge -- /usr/sbin/munged && echo munged >>"$DIR/began"; }; wait_for 10 munged munge -n
    mysqladmin ping >/dev/null 2>&1 || { (mysqld_safe --user=mysql >"$DIR/log/mysqld_safe.log" 2>&1 &); echo mysqld >>"$DIR/began"; }
    wait_for 60 MariaDB mysqladmin ping
    mysql -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
    pgrep -x slurmdbd >/dev/null || slurmdbd; wait_for 30 slurmdbd sacctmgr -n list cluster
    sacctmgr -i -Q add cluster cs336 >/dev/null 2>&1 || true; pgrep -x slurmctld >/dev/null || slurmctld; wait_for 30 slurmctld scontrol ping
    pgrep -x slurmd >/dev/null || slurmd; scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
    wait_for 60 "node $HOST" status
    echo "slurm_local.sh: one-node cluster up: $(sinfo -h -N -o '%N %t %c CPUs')"; }
status() { local d down=0; for d in $DAEMONS; do if pid_of $d >/dev/null; then echo "$d: running (pid $(pid_of $d))"; else echo "$d: not running"; down=1; fi; done
    [ $down = 0 ] && scontrol ping >/dev/null 2>&1 && sacct -n -X -S now-60 >/dev/null 2>&1 && sinfo -h -N -o %t | grep -qE '^(idle|mix|alloc)' && echo "node $HOST: $(sinfo -h -N -o %t)" && return
    echo "slurm_local.sh: the cluster is not usable (node $HOST: $(sinfo -h -N -o %t 2>/dev/null || echo unknown))"; return 1; }
stop() { local d p; for d in slurmd slurmctld slurmdbd mysqld munged; do p=$(pid_of $d) || continue  # munged and MariaDB only where start began them
    case $d in munged|mysqld) grep -qx $d "$DIR/began" 2>/dev/null || { echo "$d: left running (start did not begin it)"; continue; } ;; esac
    kill "$p"; for _ in $(seq 60); do pid_of $d >/dev/null || break; sleep 0.5; done; pid_of $d >/dev/null && echo "$d (pid $p) did not stop" >&2 || echo "$d: stopped"; done; rm -f "$DIR/began"; }
case "${1:-start}" in start) start ;; status) status ;; stop) stop ;; *) die "usage: $0 start|status|stop" ;; esac
