#!/usr/bin/env bash
# two-node-slurm.sh - a real two-node Slurm cluster on this one machine, each node in its own
# network namespace (own IP, own hostname), so that multi-node jobs cross a real network hop:
# srun places tasks on n1 (10.77.0.2) and n2 (10.77.0.3); slurmctld listens on 10.77.0.1 (a
# bridge in the root namespace). No systemd, no accounting. Root only. Idempotent.
# (Carried from shared/slurm/ for .ci/run and tests/cluster/multinode/; changed here: munged is started
# directly when it does not answer, and start-local-slurm.sh runs only to install Slurm, with
# SLURM_CONF unset and its own accounting default, so that the single-node config stays its own;
# no `cmd | grep -q` tests under pipefail.)
#
#   two-node-slurm.sh start            install (via start-local-slurm.sh) if needed, set up, start; waits idle
#   two-node-slurm.sh stop             stop the daemons it started, remove namespaces, bridge, hosts lines
#   two-node-slurm.sh kill-node NODE   SIGKILL everything running on NODE (n1 or n2): a node lost
#   two-node-slurm.sh revive-node NODE start NODE's slurmd again and return it to service
#   two-node-slurm.sh env              print the export line clients need (SLURM_CONF=...)
#
# Clients: export SLURM_CONF=$TWO_NODE_BASE/slurm.conf (default /tmp/two-node-slurm/slurm.conf),
# then sbatch/srun/squeue/sinfo as usual. It runs beside start-local-slurm.sh's single-node
# cluster (other ports: 6917/6918, other config); munge is shared.
# Knobs: TWO_NODE_BASE (default /tmp/two-node-slurm), TWO_NODE_CPUS (CPUs each node advertises,
# default max(nproc, 4); more than nproc oversubscribes), TWO_NODE_WAIT (seconds, default 60).
set -euo pipefail
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin" LC_ALL=C
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BASE=${TWO_NODE_BASE:-/tmp/two-node-slurm}
NPROC=$(nproc)
CPUS=${TWO_NODE_CPUS:-$(( NPROC > 4 ? NPROC : 4 ))}
WAIT=${TWO_NODE_WAIT:-60}
CONF=$BASE/slurm.conf
BR=p3dbr0 NET=10.77.0
NODES=(n1 n2)
HOSTS_MARK="# two-node-slurm"
export SLURM_CONF=$CONF

log() { echo "[two-node-slurm $(date +%T)] $*" >&2; }
die() { log "ERROR: $*"; for f in "$BASE"/log/*.log; do [ -f "$f" ] && { echo "----- $f" >&2; tail -n 15 "$f" >&2; }; done; exit 1; }
alive() { local p; [ -s "$1" ] || return 1; p=$(cat "$1"); [ "$(cat /proc/"$p"/comm 2>/dev/null)" = "$2" ]; }
idx() { case $1 in n1) echo 1;; n2) echo 2;; *) die "unknown node $1 (n1 or n2)";; esac; }

network_up() {
  ip link show "$BR" >/dev/null 2>&1 || ip link add "$BR" type bridge
  # (no `cmd | grep -q` tests here: grep -q exits at the first match, and under pipefail the writer's
  # SIGPIPE then reads as "not found", which made a warm start fail now and then)
  [[ $(ip addr show dev "$BR") == *" $NET.1/24 "* ]] || ip addr add "$NET.1/24" dev "$BR"
  ip link set "$BR" up
  for n in "${NODES[@]}"; do
    local i; i=$(idx "$n")
    [[ " $(ip netns list | cut -d' ' -f1 | tr '\n' ' ') " == *" p3d$n "* ]] || ip netns add "p3d$n"
    if ! ip link show "p3dv$i" >/dev/null 2>&1; then
      ip link add "p3dv$i" type veth peer name eth0 netns "p3d$n"
      ip link set "p3dv$i" master "$BR"
    fi
    ip link set "p3dv$i" up
    ip netns exec "p3d$n" sh -c "ip addr show dev eth0 | grep -q '$NET.$((i + 1))/' || ip addr add $NET.$((i + 1))/24 dev eth0; ip link set eth0 up; ip link set lo up"
    grep -q "^$NET.$((i + 1)) $n " /etc/hosts || echo "$NET.$((i + 1)) $n $HOSTS_MARK" >>/etc/hosts
  done
}

write_conf() {
  local ctl; ctl=$(hostname -s 2>/dev/null || hostname)
  mkdir -p "$BASE"/{state,spool/n1,spool/n2,log,run}
  cat >"$CONF.new" <<EOF
# written by two-node-slurm.sh
ClusterName=twonode
SlurmctldHost=$ctl($NET.1)
SlurmctldPort=6917
SlurmdPort=6918
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
# no cgroups here: plain /proc process tracking, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
# heterogeneous jobs start only in a backfill pass: every second here, not Slurm's 30 s
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=30
KillWait=5
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# node features, so that a job can ask for either node (--constraint=on_n2; a hetjob component per group)
NodeName=n1 NodeHostname=n1 NodeAddr=$NET.2 CPUs=$CPUS RealMemory=4000 Features=on_n1 State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=$NET.3 CPUs=$CPUS RealMemory=4000 Features=on_n2 State=UNKNOWN
PartitionName=two Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  if ! cmp -s "$CONF.new" "$CONF"; then mv "$CONF.new" "$CONF"; return 0; fi
  rm -f "$CONF.new"; return 1
}

start_slurmd() {  # start_slurmd NODE: slurmd inside the node's network namespace, with its own hostname
  local n=$1
  alive "$BASE/run/slurmd-$n.pid" slurmd && return 0
  # nsenter keeps the host's /sys (cgroup mounts); 'ip netns exec' would remount it empty
  nsenter --net="/var/run/netns/p3d$n" unshare --uts sh -c "hostname $n; exec slurmd -f '$CONF' -N $n" \
    >>"$BASE/log/slurmd-$n.out" 2>&1 || die "slurmd on $n did not start"
}

start_munge() {  # the shared munged (left running by stop: the single-node cluster may use it too)
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
  [ -s /etc/munge/munge.key ] || die "no /etc/munge/munge.key: run start-local-slurm.sh once"
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0711 /var/lib/munge
  install -d -o munge -g munge -m 0700 /var/log/munge
  mkdir -p "$BASE/log"
  runuser -u munge -- /usr/sbin/munged --force </dev/null >>"$BASE/log/munged.out" 2>&1 || die "munged did not start"
  local i; for i in $(seq 40); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.25; done
  die "munged does not answer"
}

wait_idle() {  # both nodes, or the one named (revive-node: the other may run a job)
  local i only=${1:-}
  for ((i = 0; i < WAIT * 2; i++)); do
    for n in "${NODES[@]}"; do
      case $(sinfo -h -n "$n" -o %t 2>/dev/null) in
        drain*|down*|inval*|fail*) scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true ;;
      esac
    done
    if [ -n "$only" ]; then
      [ "$(sinfo -h -n "$only" -o %t 2>/dev/null)" = idle ] && return 0
    else
      [ "$(sinfo -h -o %t 2>/dev/null | sort -u | tr -d '\n')" = idle ] && [ "$(sinfo -h -o %D 2>/dev/null)" = 2 ] && return 0
    fi
    sleep 0.5
  done
  die "${only:-the two nodes} did not become idle in ${WAIT}s: $(sinfo 2>&1 | tr '\n' ' ')"
}

start() {
  [ "$(id -u)" = 0 ] || die "run as root"
  if ! command -v slurmd >/dev/null; then  # installs, and starts the single-node cluster with its own config
    log "installing Slurm through start-local-slurm.sh"
    env -u SLURM_CONF "$HERE/start-local-slurm.sh" >&2
  fi
  start_munge
  network_up
  local changed=0; write_conf && changed=1
  if [ $changed = 1 ]; then  # a new config: restart everything this script owns, with empty state
    for f in "$BASE"/run/*.pid; do [ -s "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; done
    sleep 1; rm -rf "$BASE/state"/* "$BASE/spool"/*/*
  fi
  if ! alive "$BASE/run/slurmctld.pid" slurmctld; then
    slurmctld -f "$CONF" >>"$BASE/log/slurmctld.out" 2>&1 || die "slurmctld did not start"
  fi
  for i in $(seq 40); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.25; done
  for n in "${NODES[@]}"; do start_slurmd "$n"; done
  wait_idle
  log "ready: $(sinfo -h -o '%P %a %D %t %N' | tr '\n' ' '); export SLURM_CONF=$CONF"
}

stop() {
  for f in "$BASE"/run/*.pid; do
    [ -s "$f" ] || continue
    p=$(cat "$f"); c=$(cat /proc/"$p"/comm 2>/dev/null || true)
    case $c in slurmctld|slurmd) kill "$p" 2>/dev/null || true ;; esac
    rm -f "$f"
  done
  for n in "${NODES[@]}"; do
    pids=$(ip netns pids "p3d$n" 2>/dev/null || true)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
    ip netns del "p3d$n" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
  sed -i "/ $HOSTS_MARK\$/d" /etc/hosts
  log "stopped"
}

kill_node() {  # every process of the node's namespace (slurmd, slurmstepd, job tasks): the node is gone
  local n=$1; idx "$n" >/dev/null
  pids=$(ip netns pids "p3d$n" 2>/dev/null || true)
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
  rm -f "$BASE/run/slurmd-$n.pid"
  log "node $n killed (${pids//$'\n'/ })"
}

revive_node() {
  local n=$1; idx "$n" >/dev/null
  start_slurmd "$n"
  scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
  wait_idle "$n"
}

case ${1:-start} in
  start) start ;;
  stop) stop ;;
  kill-node) kill_node "${2:?node}" ;;
  revive-node) revive_node "${2:?node}" ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|kill-node NODE|revive-node NODE|env" >&2; exit 2 ;;
esac
