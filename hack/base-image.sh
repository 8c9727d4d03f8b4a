#!/usr/bin/env bash
# Base images without a container registry: a minimal Debian root filesystem made with
# debootstrap from the Debian mirror this machine's apt uses, `docker import`ed, and a small
# Python image built on top of it. Cached: an existing image is kept; the debootstrap tarball is
# kept under the cache dir (keyed by suite and architecture), so a later import skips
# debootstrap. Needs root and a running engine (hack/docker-engine.sh start).
# See docs/kind-images.md.
#
#   hack/base-image.sh            # kubetune/debian:bookworm (same as `debian`)
#   hack/base-image.sh python     # also kubetune/python:bookworm (python3, venv, `python`)
#   hack/base-image.sh tarball    # only the debootstrap tarball (no engine needed); prints its path
#   FORCE=1 hack/base-image.sh python   # re-import / rebuild the images (the tarball is reused;
#                                       # delete it to debootstrap again)
#
# Environment:
#   KUBETUNE_DEBIAN_SUITE      Debian suite (default bookworm)
#   KUBETUNE_DEBIAN_MIRROR     archive URL (default: the one in /etc/apt/sources.list*, else
#                              http://deb.debian.org/debian)
#   KUBETUNE_DEBIAN_SECURITY   security archive URL (default: from /etc/apt/sources.list*, else
#                              http://deb.debian.org/debian-security)
#   KUBETUNE_EXTRA_CA_CERTS    space-separated PEM files added to the images' trust store
#                              (default: /usr/local/share/ca-certificates/*.crt of this machine,
#                              so HTTPS from containers trusts what the host trusts; "none": none)
#   KUBETUNE_DOCKER_NETWORK    network for `docker build` RUN steps (default: the engine's
#                              default bridge; "host" uses the host's network stack)
#   KUBETUNE_IMAGE_CACHE       tarball dir (default ${XDG_CACHE_HOME:-$HOME/.cache}/kubetune/images)
#
# Exit codes: 0 ok; 1 a step failed (its output is shown); 2 a prerequisite is missing (the
# message says which and how to fix it).
set -euo pipefail

prog="base-image"
suite="${KUBETUNE_DEBIAN_SUITE:-bookworm}"
cache="${KUBETUNE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubetune/images}"
debian_image="kubetune/debian:$suite"
python_image="kubetune/python:$suite"
network="${KUBETUNE_DOCKER_NETWORK:-}"
force="${FORCE:-0}"

say() { echo "$prog: $*" >&2; }
missing() {
  echo "$prog: $1" >&2
  exit 2
}
fail() {
  echo "$prog: $1" >&2
  exit 1
}

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

arch() { dpkg --print-architecture 2>/dev/null || uname -m; }

# The first archive URL in this machine's apt sources that serves `suite_re` (one-line and
# deb822 formats), else the fallback.
apt_mirror() {
  local suite_re="$1" fallback="$2" url
  url="$(
    {
      cat /etc/apt/sources.list 2>/dev/null || true
      for f in /etc/apt/sources.list.d/*.list; do [[ -r "$f" ]] && cat "$f"; done
    } | awk -v re="^$suite_re\$" '$1 == "deb" {
        i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
        if ($(i + 1) ~ re) { print $i; exit }
      }'
  )"
  if [[ -z "$url" ]]; then
    url="$(
      for f in /etc/apt/sources.list.d/*.sources; do [[ -r "$f" ]] && { cat "$f"; echo; }; done |
        awk -v re="^$suite_re\$" '
          /^[ \t]*$/ { if (uris != "" && hit && deb) { print uris; exit } uris = ""; hit = 0; deb = 0; next }
          /^Types:/ { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
          /^URIs:/ { uris = $2 }
          /^Suites:/ { for (i = 2; i <= NF; i++) if ($i ~ re) hit = 1 }
          END { if (uris != "" && hit && deb) print uris }' | head -n 1
    )"
  fi
  echo "${url:-$fallback}"
}

# Another suite than the host's: the same mirrors as the host's own suite.
host_suite="$(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release 2>/dev/null | tr -d '"' || true)"
mirror="${KUBETUNE_DEBIAN_MIRROR:-$(apt_mirror "$suite" "$(apt_mirror "${host_suite:-none}" http://deb.debian.org/debian)")}"
security="${KUBETUNE_DEBIAN_SECURITY:-$(apt_mirror "$suite-security" "$(apt_mirror "${host_suite:-none}-security" http://deb.debian.org/debian-security)")}"
tarball="$cache/debian-$suite-$(arch)-minbase.tar"

need_root() {
  [[ "$(id -u)" == 0 ]] || missing "debootstrap and docker need root (run as root, e.g. with sudo)"
}

need_engine() {
  command -v docker >/dev/null 2>&1 ||
    missing "the docker CLI is not on PATH: apt-get install docker.io (or run hack/docker-engine.sh start, which installs it)"
  docker info >/dev/null 2>&1 ||
    missing "no Docker engine answers at ${DOCKER_HOST:-the default socket}: run hack/docker-engine.sh start"
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

# `docker build` with the legacy builder: the docker CLI here may lack the buildx plugin that
# BuildKit needs, and the legacy builder is enough for these Dockerfiles.
build() {
  DOCKER_BUILDKIT=0 docker build ${network:+--network "$network"} "$@"
}

# Unmount whatever is still mounted below $1 (debootstrap mounts proc/sys in the target and
# leaves them behind when it fails), deepest first, then remove it without crossing into any
# other filesystem.
remove_tree() {
  local dir="$1" m
  [[ -n "$dir" && -d "$dir" ]] || return 0
  while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done < <(awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r)
  rm -rf --one-file-system "$dir"
}

make_tarball() {
  if [[ -s "$tarball" ]]; then
    say "debootstrap tarball cached: $tarball ($(du -h "$tarball" | cut -f1))"
    return 0
  fi
  need_root
  if ! command -v debootstrap >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 || missing "debootstrap not found: install it (Debian package debootstrap)"
    say "installing debootstrap from Debian"
    apt-get update -qq || missing "apt-get update failed: check /etc/apt/sources.list* and the network to the Debian mirror"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null ||
      missing "apt-get install debootstrap failed: run it by hand to see why"
  fi
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  [[ -r "$keyring" ]] || missing "$keyring missing: apt-get install debian-archive-keyring"
  [[ -e "/usr/share/debootstrap/scripts/$suite" ]] ||
    missing "debootstrap here does not know the suite '$suite': set KUBETUNE_DEBIAN_SUITE (e.g. bookworm) or upgrade debootstrap"

  mkdir -p "$cache"
  local rootfs t0
  rootfs="$(mktemp -d "$cache/.rootfs-$suite.XXXXXX")"
  # shellcheck disable=SC2064  # expand now: the path is fixed
  trap "remove_tree '$rootfs'; rm -f '$tarball.tmp'" EXIT
  say "debootstrap --variant=minbase $suite from $mirror (takes a few minutes the first time)"
  t0=$SECONDS
  if ! debootstrap --variant=minbase --include=ca-certificates --keyring="$keyring" \
    "$suite" "$rootfs" "$mirror" >"$cache/debootstrap-$suite.log" 2>&1; then
    tail -n 30 "$cache/debootstrap-$suite.log" >&2
    [[ -f "$rootfs/debootstrap/debootstrap.log" ]] && tail -n 30 "$rootfs/debootstrap/debootstrap.log" >&2
    fail "debootstrap failed (log: $cache/debootstrap-$suite.log)"
  fi
  say "debootstrap done in $((SECONDS - t0))s"

  # Apt sources as on this machine: the suite, its updates and its security archive.
  rm -f "$rootfs/etc/apt/sources.list"
  {
    echo "Types: deb"
    echo "URIs: $mirror"
    case "$suite" in
      sid | unstable) echo "Suites: $suite" ;;
      *) echo "Suites: $suite $suite-updates" ;;
    esac
    echo "Components: main"
    echo "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
    case "$suite" in
      sid | unstable) ;;
      *)
        echo
        echo "Types: deb"
        echo "URIs: $security"
        echo "Suites: $suite-security"
        echo "Components: main"
        echo "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
        ;;
    esac
  } >"$rootfs/etc/apt/sources.list.d/debian.sources"
  # Container conventions (as Debian's official images): no services started by package
  # scripts, no apt caches kept, no docs, man pages or translations installed.
  printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
  chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
  cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  printf 'Acquire::Languages "none";\n' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
  find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
  rm -rf "$rootfs/usr/share/man/"* "$rootfs/usr/share/info/"* "$rootfs/usr/share/locale/"* \
    "$rootfs/var/lib/apt/lists/"* "$rootfs/var/cache/apt/"*.bin "$rootfs/var/cache/apt/archives/"*.deb \
    "$rootfs/var/log/"*.log "$rootfs/var/log/apt/"* "$rootfs/debootstrap" "$rootfs/etc/machine-id" \
    "$rootfs/etc/hostname" "$rootfs/etc/resolv.conf"
  : >"$rootfs/etc/machine-id"

  # No device nodes or mounts in the layer: the engine provides /dev, /proc and /sys.
  tar --numeric-owner --xattrs --one-file-system -C "$rootfs" \
    --exclude=./dev/* --exclude=./proc/* --exclude=./sys/* -cf "$tarball.tmp" .
  mv -f "$tarball.tmp" "$tarball"
  {
    echo "suite=$suite"
    echo "arch=$(arch)"
    echo "mirror=$mirror"
    echo "security=$security"
    echo "created=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "debootstrap=$(debootstrap --version 2>/dev/null | awk '{print $2}')"
    echo "packages=$(chroot "$rootfs" dpkg-query -W -f '.\n' 2>/dev/null | wc -l)"
  } >"$tarball.info"
  remove_tree "$rootfs"
  trap - EXIT
  say "tarball: $tarball ($(du -h "$tarball" | cut -f1)), made in $((SECONDS - t0))s"
}

extra_ca_files() {
  local spec="${KUBETUNE_EXTRA_CA_CERTS-}" f
  if [[ "$spec" == none ]]; then
    return 0
  fi
  if [[ -z "$spec" ]]; then
    for f in /usr/local/share/ca-certificates/*.crt; do
      [[ -f "$f" ]] && echo "$f"
    done
    return 0
  fi
  for f in $spec; do
    [[ -r "$f" ]] || missing "KUBETUNE_EXTRA_CA_CERTS: cannot read $f"
    echo "$f"
  done
}

make_debian_image() {
  if image_exists "$debian_image" && [[ "$force" != 1 ]]; then
    say "$debian_image exists ($(docker image inspect -f '{{.Size}}' "$debian_image" | awk '{printf "%.0f MB", $1 / 1e6}'))"
    return 0
  fi
  make_tarball
  local t0=$SECONDS cas=() tmp f
  mapfile -t cas < <(extra_ca_files)
  local plain="$debian_image"
  ((${#cas[@]} > 0)) && plain="$debian_image-rootfs"
  say "docker import $tarball as $plain"
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["bash"]' \
    --message "debootstrap --variant=minbase $suite ($mirror)" \
    "$tarball" "$plain" >/dev/null
  if ((${#cas[@]} > 0)); then
    # The host's own CAs as one extra layer: the cached tarball stays plain Debian.
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT
    mkdir "$tmp/certs"
    for f in "${cas[@]}"; do
      cp "$f" "$tmp/certs/$(basename "${f%.*}").crt"
    done
    cat >"$tmp/Dockerfile" <<EOF
FROM $plain
COPY certs/ /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null
EOF
    say "adding ${#cas[@]} CA certificate(s) of this machine: ${cas[*]}"
    DOCKER_BUILDKIT=0 docker build --network none -q -t "$debian_image" "$tmp" >/dev/null ||
      fail "adding the CA certificates failed: rerun 'docker build $tmp' by hand to see why"
    rm -rf "$tmp"
    trap - EXIT
    docker rmi "$plain" >/dev/null 2>&1 || true
  fi
  say "$debian_image ready in $((SECONDS - t0))s ($(docker image inspect -f '{{.Size}}' "$debian_image" | awk '{printf "%.0f MB", $1 / 1e6}'))"
}

make_python_image() {
  if image_exists "$python_image" && [[ "$force" != 1 ]]; then
    say "$python_image exists ($(docker image inspect -f '{{.Size}}' "$python_image" | awk '{printf "%.0f MB", $1 / 1e6}'))"
    return 0
  fi
  local t0=$SECONDS
  say "building $python_image FROM $debian_image (python3, python3-venv, python-is-python3 from $mirror)${network:+, network $network}"
  # python-is-python3: the project's Dockerfiles run `python`. pip comes with every venv
  # (python3-venv ships ensurepip's wheels), so python3-pip is not needed.
  if ! build -t "$python_image" - <<EOF; then
FROM $debian_image
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 python3-venv python-is-python3 \\
 && rm -rf /var/lib/apt/lists/* \\
 && python --version
CMD ["python3"]
EOF
    fail "building $python_image failed (output above). If the RUN step cannot reach $mirror, try KUBETUNE_DOCKER_NETWORK=host"
  fi
  say "$python_image ready in $((SECONDS - t0))s ($(docker image inspect -f '{{.Size}}' "$python_image" | awk '{printf "%.0f MB", $1 / 1e6}'))"
}

case "${1:-debian}" in
  debian)
    need_engine
    make_debian_image
    echo "$debian_image"
    ;;
  python)
    need_engine
    make_debian_image
    make_python_image
    echo "$python_image"
    ;;
  tarball)
    make_tarball
    echo "$tarball"
    ;;
  -h | --help | help) usage ;;
  *)
    usage >&2
    exit 2
    ;;
esac
