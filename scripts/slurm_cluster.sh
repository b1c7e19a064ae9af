#!/usr/bin/env bash
# A real Slurm cluster of N nodes on this one machine, for the multi-node tests and for trying `angel-jax launch`
# inside an allocation: Debian's slurm-wlm and munge, one slurmctld and N `slurmd -N nK` (NodeAddr=127.0.0.1, a
# port each), node names n1..nN in /etc/hosts (jax's Slurm detection resolves the first node's name).
#
#   scripts/slurm_cluster.sh start DIR [N]   install what is missing (root, apt), write DIR/slurm.conf, start the
#                                            daemons, wait until every node is idle; prints `export SLURM_CONF=...`
#   scripts/slurm_cluster.sh stop DIR        stop this cluster's daemons (munged is left to the machine)
#   scripts/slurm_cluster.sh status DIR      sinfo of this cluster
#   scripts/slurm_cluster.sh kill-node DIR NODE   SIGKILL everything of NODE at once, as when its machine goes: its
#                                            slurmd, the slurmstepd of its job steps and their tasks
#   scripts/slurm_cluster.sh revive DIR NODE      start NODE's slurmd again
#
# Every path it writes is under DIR (state, spool, logs, pids) except /etc/hosts (one line, added once) and munge's
# key (created by the munge package where missing). Exit status 3 (and one line saying why) where the cluster
# cannot be had here: not root, no package, a daemon that does not come up.
set -euo pipefail

usage="usage: slurm_cluster.sh start|stop|status DIR [N], or kill-node|revive DIR NODE"
cmd=${1:?$usage}
dir=${2:?$usage}
nodes=${3:-3}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
conf="$dir/slurm.conf"
ctld_port=${SLURM_TEST_CTLD_PORT:-16817}
node_port0=${SLURM_TEST_NODE_PORT:-16900}

cannot() { echo "slurm_cluster: $*" >&2; exit 3; }

install() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return 0
  [ "$(id -u)" = 0 ] || cannot "slurm-wlm and munge are not installed and installing them needs root"
  command -v apt-get >/dev/null || cannot "slurm-wlm and munge are not installed and there is no apt-get"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) \
    >"$dir/apt.log" 2>&1 || cannot "apt-get install slurm-wlm munge failed (see $dir/apt.log)"
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
  [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 0400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  if id munge >/dev/null 2>&1; then
    su -s /bin/sh munge -c "munged" 2>"$dir/munged.err" || munged --force 2>>"$dir/munged.err" || true
  else
    munged --force 2>"$dir/munged.err" || true
  fi
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  cannot "munged did not start (see $dir/munged.err)"
}

hosts() {
  local names
  names=$(seq -f "n%g" 1 "$nodes" | tr '\n' ' ')
  for n in $names; do
    getent hosts "$n" >/dev/null && continue
    echo "127.0.0.1 $n" >>/etc/hosts
  done
}

write_conf() {
  local cpus mem
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  cat >"$conf" <<CONF
# Written by scripts/slurm_cluster.sh: $nodes nodes on this machine.
ClusterName=angeljax
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=$ctld_port
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=30
MessageTimeout=10
CONF
  for i in $(seq 1 "$nodes"); do
    echo "NodeName=n$i NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$((node_port0 + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN" >>"$conf"
  done
  echo "PartitionName=debug Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" >>"$conf"
}

stop() {
  [ -f "$conf" ] || return 0
  for pidfile in "$dir"/slurmd.*.pid "$dir"/slurmctld.pid; do
    [ -f "$pidfile" ] || continue
    kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 0.5
  for pidfile in "$dir"/slurmd.*.pid "$dir"/slurmctld.pid; do
    [ -f "$pidfile" ] || continue
    kill -9 "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
  done
  pkill -9 -f -- "-f $conf" 2>/dev/null || true  # a daemon whose pid file is gone
}

case "$cmd" in
  start)
    [ "$(id -u)" = 0 ] || cannot "a cluster on this machine needs root (the daemons, /etc/hosts)"
    install
    start_munge
    hosts
    stop
    for port in "$ctld_port" $(seq $((node_port0 + 1)) $((node_port0 + nodes))); do
      if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        cannot "port $port is in use (another cluster? set SLURM_TEST_CTLD_PORT / SLURM_TEST_NODE_PORT)"
      fi
    done
    write_conf
    export SLURM_CONF="$conf"
    slurmctld -f "$conf" -i || cannot "slurmctld did not start (see $dir/log/slurmctld.log)"
    for i in $(seq 1 "$nodes"); do
      slurmd -f "$conf" -N "n$i" || cannot "slurmd -N n$i did not start (see $dir/log/slurmd.n$i.log)"
    done
    for _ in $(seq 150); do
      idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | wc -l)
      [ "$idle" -ge "$nodes" ] && { echo "export SLURM_CONF=$conf"; exit 0; }
      sleep 0.2
    done
    sinfo -N >&2 || true
    cannot "not every node became idle within 30 s (see $dir/log/)"
    ;;
  stop) stop ;;
  status) SLURM_CONF="$conf" sinfo -N ;;
  kill-node)
    node=${3:?$usage}
    victims=$(cat "$dir/slurmd.$node.pid")
    for step in $(SLURM_CONF="$conf" squeue -s -h -o '%i %N' | awk -v node="$node" '$2 == node {print $1}'); do
      for pid in $(pgrep -f "slurmstepd: \\[$step\\]" || true); do
        victims="$victims $pid $(pgrep -P "$pid" || true)"  # (its tasks; their own children die with the session)
      done
    done
    kill -KILL $victims 2>/dev/null || true
    ;;
  revive) slurmd -f "$conf" -N "${3:?$usage}" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
