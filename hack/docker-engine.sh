#!/usr/bin/env bash
# Start, stop or inspect a Docker engine of the project's own on a machine that has only the
# docker CLI (no engine, no container registry). Needs root. See docs/kind-images.md.
#
#   hack/docker-engine.sh start    # install Debian's docker.io if needed, start dockerd, wait for it
#   hack/docker-engine.sh status   # is an engine answering? which one, which storage driver
#   hack/docker-engine.sh stop     # SIGTERM dockerd, wait, SIGKILL; no dockerd/containerd left
#   hack/docker-engine.sh logs     # the tail of dockerd's log
#
# Environment:
#   DOCKER_HOST                      socket to serve and talk to (unix:// only;
#                                    default unix:///var/run/docker.sock)
#   KUBETUNE_DOCKER_ROOT             state dir (default ${XDG_CACHE_HOME:-$HOME/.cache}/kubetune/docker):
#                                    data/ (images, containers), dockerd.log, dockerd.pid, storage-driver
#   KUBETUNE_DOCKER_EXEC_ROOT        runtime state, sockets of containerd and its shims
#                                    (default /run/kubetune-docker: kept short for socket paths)
#   KUBETUNE_DOCKER_STORAGE_DRIVER   overlay2 | fuse-overlayfs | vfs (default: the first that works
#                                    here, remembered in $KUBETUNE_DOCKER_ROOT/storage-driver)
#   KUBETUNE_DOCKER_MTU              MTU of container networks (default: the default route's MTU
#                                    when below 1500, else Docker's default)
#   KUBETUNE_DOCKER_START_TIMEOUT    seconds to wait for `docker info` (default 90)
#   KUBETUNE_DOCKER_STOP_TIMEOUT     seconds between SIGTERM and SIGKILL (default 30)
#   KUBETUNE_DOCKER_NO_INSTALL=1     never apt-get install; exit 2 when dockerd is missing
#   KUBETUNE_DOCKER_BOUNDED_RUNC     auto | 1 | 0 (default auto): make hack/kind-images/runc-bounded
#                                    the default runtime, so privileged containers (kind's nodes)
#                                    start where this machine's capability bounding set lacks some
#                                    capability; auto does so only when it does
#
# Exit codes: 0 ok; 1 the engine failed to start or stop (the log tail is printed);
# 2 a prerequisite is missing (the message says which and how to fix it); 3 `status`: not running.
set -euo pipefail

prog="docker-engine"
cleaned=0
cache_home="${XDG_CACHE_HOME:-$HOME/.cache}"
root="${KUBETUNE_DOCKER_ROOT:-$cache_home/kubetune/docker}"
exec_root="${KUBETUNE_DOCKER_EXEC_ROOT:-/run/kubetune-docker}"
data_root="$root/data"
pidfile="$root/dockerd.pid"
logfile="$root/dockerd.log"
driver_file="$root/storage-driver"
start_timeout="${KUBETUNE_DOCKER_START_TIMEOUT:-90}"
stop_timeout="${KUBETUNE_DOCKER_STOP_TIMEOUT:-30}"
export DOCKER_HOST="${DOCKER_HOST:-unix:///var/run/docker.sock}"

say() { echo "$prog: $*"; }
err() { echo "$prog: $*" >&2; }
missing() { err "$1"; exit 2; }

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

socket_path() {
  case "$DOCKER_HOST" in
    unix://*) echo "${DOCKER_HOST#unix://}" ;;
    *) missing "DOCKER_HOST=$DOCKER_HOST: only unix:// sockets are served by this script (e.g. unix:///var/run/docker.sock)" ;;
  esac
}

engine_answers() { docker info >/dev/null 2>&1; }

# The pid of the dockerd this script started, if it is still alive.
our_pid() {
  local pid
  [[ -f "$pidfile" ]] || return 1
  pid="$(cat "$pidfile" 2>/dev/null || true)"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [[ -r "/proc/$pid/cmdline" ]] || return 1
  tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q -- "--data-root $data_root" || return 1
  echo "$pid"
}

# Every descendant of a pid (containerd, shims, docker-proxy under dockerd).
descendants() {
  local parent="$1" pid ppid
  for pid in /proc/[0-9]*; do
    pid="${pid#/proc/}"
    ppid="$(awk '{print $4}' "/proc/$pid/stat" 2>/dev/null || true)"
    if [[ "$ppid" == "$parent" ]]; then
      echo "$pid"
      descendants "$pid"
    fi
  done
}

# dockerd, containerd and shim processes that belong to this engine (the program is one of
# those and its command line names our data root or exec root): whatever else runs on the
# machine is left alone.
our_processes() {
  local pid cmd comm
  for pid in /proc/[0-9]*; do
    pid="${pid#/proc/}"
    comm="$(cat 2>/dev/null "/proc/$pid/comm" || true)"
    case "$comm" in
      dockerd | containerd | containerd-shim*) ;;
      *) continue ;;
    esac
    cmd="$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" || true)"
    case "$cmd" in
      *"$data_root"* | *"$exec_root"*) echo "$pid" ;;
    esac
  done
}

need_root() {
  [[ "$(id -u)" == 0 ]] || missing "dockerd needs root (run as root, e.g. with sudo)"
}

# Install Debian's engine (docker.io pulls containerd, runc, iptables, tini) when dockerd or a
# piece it execs is missing. Services are not started by the package here: policy-rc.d or the
# absence of systemd keeps them off; this script starts its own dockerd.
ensure_installed() {
  local want=() bin
  for bin in dockerd containerd containerd-shim-runc-v2 runc iptables; do
    command -v "$bin" >/dev/null 2>&1 || want+=("$bin")
  done
  [[ ${#want[@]} -eq 0 ]] && return 0
  if [[ "${KUBETUNE_DOCKER_NO_INSTALL:-0}" == 1 ]]; then
    missing "${want[*]} not found: apt-get install docker.io containerd runc iptables (or unset KUBETUNE_DOCKER_NO_INSTALL)"
  fi
  command -v apt-get >/dev/null 2>&1 ||
    missing "${want[*]} not found and no apt-get: install a Docker engine (dockerd, containerd, runc, iptables)"
  say "installing Debian's docker.io (missing: ${want[*]})"
  local t0=$SECONDS
  apt-get update -qq ||
    missing "apt-get update failed: check /etc/apt/sources.list* and the network to the Debian mirror"
  mkdir -p "$root"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    docker.io containerd runc iptables tini >"$root/apt.log" 2>&1; then
    tail -n 20 "$root/apt.log" >&2
    missing "apt-get install docker.io containerd runc iptables tini failed (log: $root/apt.log)"
  fi
  say "installed in $((SECONDS - t0))s: $(dockerd --version 2>/dev/null || echo dockerd)"
  # The package may have started its own engine (on a machine with systemd); this script uses
  # its own data root, so the packaged one is not needed.
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet docker 2>/dev/null; then
    say "note: the packaged docker.service is running too; 'systemctl disable --now docker docker.socket' stops it"
  fi
}

# Can the kernel mount overlayfs on top of the data root's filesystem?
overlay_works() {
  local d rc=1
  d="$(mktemp -d "$root/.overlay-probe.XXXXXX")"
  mkdir -p "$d/lower" "$d/upper" "$d/work" "$d/merged"
  touch "$d/lower/probe"
  if mount -t overlay overlay -o "lowerdir=$d/lower,upperdir=$d/upper,workdir=$d/work" "$d/merged" 2>/dev/null; then
    [[ -e "$d/merged/probe" ]] && rc=0
    umount "$d/merged" 2>/dev/null || true
  fi
  rm -rf "$d"
  return "$rc"
}

fuse_overlayfs_works() {
  [[ -c /dev/fuse ]] || return 1
  if ! command -v fuse-overlayfs >/dev/null 2>&1; then
    [[ "${KUBETUNE_DOCKER_NO_INSTALL:-0}" == 1 ]] && return 1
    command -v apt-get >/dev/null 2>&1 || return 1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends fuse-overlayfs >/dev/null 2>&1 || return 1
  fi
  return 0
}

# The storage driver: an explicit choice, else the one used before on this data root (images
# stored by one driver are invisible to another), else overlay2, fuse-overlayfs, vfs in turn.
pick_driver() {
  if [[ -n "${KUBETUNE_DOCKER_STORAGE_DRIVER:-}" ]]; then
    echo "$KUBETUNE_DOCKER_STORAGE_DRIVER"
    return
  fi
  if [[ -s "$driver_file" ]]; then
    cat "$driver_file"
    return
  fi
  if overlay_works; then
    echo overlay2
  elif fuse_overlayfs_works; then
    echo fuse-overlayfs
  else
    echo vfs
  fi
}

default_mtu() {
  local dev mtu
  dev="$(ip -o route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')"
  [[ -n "$dev" && -r "/sys/class/net/$dev/mtu" ]] || return 0
  mtu="$(cat "/sys/class/net/$dev/mtu")"
  [[ "$mtu" =~ ^[0-9]+$ && "$mtu" -lt 1500 ]] && echo "$mtu"
  return 0
}

# Does this process's capability bounding set lack a capability the kernel knows? Privileged
# containers then fail in runc ("unable to apply caps"), and the runc-bounded wrapper is needed.
bounding_set_incomplete() {
  local last bnd
  last="$(cat /proc/sys/kernel/cap_last_cap 2>/dev/null)" || return 1
  bnd="$(awk '/^CapBnd:/ {print $2}' /proc/self/status)"
  [[ -n "$bnd" ]] || return 1
  (( 16#$bnd != (1 << (last + 1)) - 1 ))
}

use_bounded_runc() {
  case "${KUBETUNE_DOCKER_BOUNDED_RUNC:-auto}" in
    1 | true | yes) return 0 ;;
    0 | false | no) return 1 ;;
    auto) bounding_set_incomplete ;;
    *) missing "KUBETUNE_DOCKER_BOUNDED_RUNC=${KUBETUNE_DOCKER_BOUNDED_RUNC}: use auto, 1 or 0" ;;
  esac
}

# The log of the latest start only (each start writes a "=== date dockerd args" header).
last_run_log() {
  [[ -f "$logfile" ]] || return 0
  awk '/^=== / {buf = ""} {buf = buf $0 "\n"} END {printf "%s", buf}' "$logfile"
}

log_tail() {
  [[ -f "$logfile" ]] || { err "(no log at $logfile)"; return 0; }
  err "--- errors in $logfile (latest start) ---"
  last_run_log | grep -iE 'level=(error|fatal)|^failed|panic' | tail -n 10 >&2 || true
  err "--- last 15 lines ---"
  last_run_log | tail -n 15 >&2
  err "---"
}

cmd_start() {
  local sock pid driver mtu args t0
  command -v docker >/dev/null 2>&1 ||
    missing "the docker CLI is not on PATH: apt-get install docker.io (it ships one) or install docker-ce-cli"
  sock="$(socket_path)"
  if pid="$(our_pid)" && engine_answers; then
    say "already running (pid $pid, $DOCKER_HOST, storage driver $(docker info --format '{{.Driver}}' 2>/dev/null))"
    return 0
  fi
  if engine_answers; then
    say "an engine not started by this script already answers at $DOCKER_HOST: using it ($(docker info --format '{{.ServerVersion}}, storage driver {{.Driver}}' 2>/dev/null))"
    return 0
  fi
  need_root
  ensure_installed
  if pid="$(our_pid)"; then
    err "dockerd (pid $pid) runs but does not answer at $DOCKER_HOST: stopping it first"
    cmd_stop
  fi
  mkdir -p "$root" "$data_root" "$exec_root" "$(dirname "$sock")"
  if [[ -S "$sock" ]]; then
    # A socket nobody answers on (an engine that died): dockerd refuses to start over it.
    rm -f "$sock"
  fi
  driver="$(pick_driver)"
  mtu="${KUBETUNE_DOCKER_MTU:-$(default_mtu)}"
  args=(
    --host "$DOCKER_HOST"
    --data-root "$data_root"
    --exec-root "$exec_root"
    --pidfile "$pidfile"
    --storage-driver "$driver"
    --exec-opt native.cgroupdriver=cgroupfs
    --log-level info
  )
  [[ -n "$mtu" ]] && args+=(--mtu "$mtu")
  local wrapper
  wrapper="$(cd "$(dirname "$0")" && pwd)/kind-images/runc-bounded"
  if use_bounded_runc; then
    [[ -x "$wrapper" ]] || missing "$wrapper is missing or not executable"
    args+=(--add-runtime "runc-bounded=$wrapper" --default-runtime runc-bounded)
    say "the capability bounding set lacks some capabilities: default runtime is $wrapper"
  fi
  say "starting dockerd: storage driver $driver${mtu:+, MTU $mtu}, data root $data_root, socket $DOCKER_HOST"
  {
    echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) dockerd ${args[*]}"
  } >>"$logfile"
  t0=$SECONDS
  # setsid: the daemon outlives this shell and its terminal; stdin closed.
  setsid dockerd "${args[@]}" </dev/null >>"$logfile" 2>&1 &
  local launched=$!
  while ! engine_answers; do
    if ! running "$launched" && ! our_pid >/dev/null; then
      err "dockerd exited during start-up (storage driver $driver)"
      log_tail
      if [[ -z "${KUBETUNE_DOCKER_STORAGE_DRIVER:-}" && "$driver" != vfs && ! -s "$driver_file" ]] &&
        last_run_log | tail -n +2 | grep -qiE 'storage|graphdriver|overlay'; then
        say "retrying with the vfs storage driver (slow, but works everywhere)"
        KUBETUNE_DOCKER_STORAGE_DRIVER=vfs cmd_start
        return
      fi
      exit 1
    fi
    if ((SECONDS - t0 >= start_timeout)); then
      err "no answer from dockerd at $DOCKER_HOST after ${start_timeout}s"
      log_tail
      cmd_stop >&2 || true
      exit 1
    fi
    sleep 0.5
  done
  echo "$driver" >"$driver_file"
  say "ready in $((SECONDS - t0))s: pid $(our_pid || echo "$launched"), $(docker info --format 'Docker {{.ServerVersion}}, storage driver {{.Driver}}, cgroup {{.CgroupDriver}}' 2>/dev/null)"
  say "log: $logfile"
}

# Is the process there and not a zombie?
running() {
  local state
  state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)"
  [[ -n "$state" && "$state" != Z ]]
}

# Container processes of this engine that outlived it (dockerd and the shims were SIGKILLed):
# runc's own view first, then whatever is left in the cgroups of our containers.
kill_containers() {
  local runc_root="$exec_root/runtime-runc/moby" id ids=() procs=() d
  if command -v runc >/dev/null 2>&1 && [[ -d "$runc_root" ]]; then
    mapfile -t ids < <(runc --root "$runc_root" list -q 2>/dev/null || true)
    for id in "${ids[@]}"; do
      [[ -n "$id" ]] || continue
      say "removing leftover container ${id:0:12}"
      cleaned=1
      runc --root "$runc_root" delete --force "$id" >/dev/null 2>&1 || true
    done
  fi
  for d in "$data_root"/containers/*/; do
    [[ -d "$d" ]] || continue
    id="$(basename "$d")"
    mapfile -t -O "${#procs[@]}" procs < <(find /sys/fs/cgroup -path "*$id*" -name cgroup.procs -exec cat {} + 2>/dev/null || true)
  done
  mapfile -t procs < <(printf '%s\n' "${procs[@]}" | grep -E '^[0-9]+$' | sort -un || true)
  if [[ ${#procs[@]} -gt 0 ]]; then
    say "killing leftover container processes: ${procs[*]}"
    cleaned=1
    kill -KILL "${procs[@]}" 2>/dev/null || true
    sleep 1
  fi
}

alive() {
  local p
  for p in "$@"; do
    if running "$p"; then echo "$p"; fi
  done
  return 0
}

cmd_stop() {
  local pid pids=() left=() kids=() t0
  if ! pid="$(our_pid)"; then
    pid=""
  fi
  if [[ -n "$pid" ]]; then
    mapfile -t kids < <(descendants "$pid")
    # Containers are stopped by dockerd itself on SIGTERM (live-restore is off).
    say "stopping dockerd (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    t0=$SECONDS
    while running "$pid" && ((SECONDS - t0 < stop_timeout)); do
      sleep 0.5
    done
    if running "$pid"; then
      err "dockerd (pid $pid) still alive after ${stop_timeout}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  # containerd and shims that outlived dockerd (after a SIGKILL), and its other children
  # (docker-proxy): TERM, then KILL.
  mapfile -t pids < <({ our_processes; alive "${kids[@]}"; } | sort -un)
  if [[ ${#pids[@]} -gt 0 ]]; then
    say "stopping leftover processes of this engine: ${pids[*]}"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    t0=$SECONDS
    while ((SECONDS - t0 < 10)); do
      mapfile -t left < <(alive "${pids[@]}")
      [[ ${#left[@]} -eq 0 ]] && break
      sleep 0.5
    done
    mapfile -t left < <(alive "${pids[@]}")
    if [[ ${#left[@]} -gt 0 ]]; then
      kill -KILL "${left[@]}" 2>/dev/null || true
      sleep 1
    fi
  fi
  kill_containers
  mapfile -t left < <(our_processes)
  if [[ ${#left[@]} -gt 0 ]]; then
    err "processes of this engine still alive: ${left[*]}"
    exit 1
  fi
  # Mounts left by a killed engine (overlay layers, netns files) under our roots.
  local m
  while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done < <(awk -v a="$data_root" -v b="$exec_root" 'index($2, a) == 1 || index($2, b) == 1 {print $2}' /proc/self/mounts | sort -r)
  rm -f "$pidfile"
  if [[ -z "$pid" && ${#pids[@]} -eq 0 && "$cleaned" == 0 ]]; then
    if engine_answers; then
      say "not started by this script; an engine at $DOCKER_HOST is left alone"
    else
      say "not running"
    fi
  else
    say "stopped"
  fi
}

cmd_status() {
  local pid
  if pid="$(our_pid)"; then
    if engine_answers; then
      say "running (pid $pid) at $DOCKER_HOST: $(docker info --format 'Docker {{.ServerVersion}}, storage driver {{.Driver}}, {{.Images}} images, {{.Containers}} containers ({{.ContainersRunning}} running)' 2>/dev/null)"
      say "data root $data_root, log $logfile"
      return 0
    fi
    say "dockerd (pid $pid) is alive but does not answer at $DOCKER_HOST; log: $logfile"
    return 1
  fi
  if engine_answers; then
    say "an engine not started by this script answers at $DOCKER_HOST: $(docker info --format 'Docker {{.ServerVersion}}, storage driver {{.Driver}}' 2>/dev/null)"
    return 0
  fi
  say "not running (no engine answers at $DOCKER_HOST)"
  return 3
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  logs) tail -n "${2:-60}" "$logfile" ;;
  -h | --help | help) usage ;;
  *)
    usage >&2
    exit 2
    ;;
esac
