#!/usr/bin/env bash
# A kind node image built without any container registry: every binary is compiled from Go
# modules (or C), every image is built FROM the local Debian image, and all images the cluster
# needs are baked into the node's containerd, so `kind create cluster --image <it>` pulls
# nothing.
#
#   hack/kind-node-image.sh          # build what is missing; print the node image name (stdout)
#   FORCE=1 hack/kind-node-image.sh  # rebuild every image without the layer cache (binaries
#                                    # stay cached)
#
# Builds, cached under ${XDG_CACHE_HOME:-~/.cache}/kubetune/ and keyed by version:
#   bin/node-<kube>/        kubeadm, kubelet, kube-proxy (k8s.io/kubernetes at <kube>), plus
#                           copies of kube-apiserver, kube-controller-manager, kube-scheduler,
#                           kubectl and etcd from the project's own build (bin/k8s-<kube>/,
#                           made by `python -m kubetune_dev.binaries build`)
#   bin/kind-node/<name>-<version>/  containerd + ctr + containerd-shim-runc-v2, crictl, CNI plugins
#                           (host-local, loopback, ptp, portmap), coredns,
#                           local-path-provisioner, pause (gcc -static)
# Images (docker): registry.k8s.io/{kube-apiserver,kube-controller-manager,kube-scheduler,
# kube-proxy}:<kube>, registry.k8s.io/{etcd,coredns/coredns,pause}:<tags kubeadm lists>, the
# kindnetd / local-path-provisioner / local-path-helper tags kind's node image build bakes in,
# kubetune/kind-base:<kind> (kind's images/base rebuilt) and finally the node image
# kubetune/kind-node:<kube>. See docs/kind-images.md.
#
# Needs: a running Docker engine (hack/docker-engine.sh start), the image
# kubetune/debian:bookworm (hack/base-image.sh), go, gcc with a static libc, python3.
# Exit 2: a prerequisite is missing (the message says which).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

KUBE_VERSION=${KUBE_VERSION:-v1.37.1}
# The kind release whose base image, manifests and image names are reproduced. kind v0.31.0
# writes kubeadm's v1beta3 config, which kubeadm v1.37 no longer reads; v0.33.0 writes v1beta4.
KIND_VERSION=${KIND_VERSION:-v0.33.0}
# containerd, CNI plugins and crictl: the versions kind's images/base/Dockerfile pins (read below),
# unless set here. kind builds local-path-provisioner v0.0.34 (v0.32 for kind v0.31.0); the Go
# module proxy serves v0.0.30 of it and refuses the newer ones (403).
LOCAL_PATH_VERSION=${LOCAL_PATH_VERSION:-v0.0.30}
DEBIAN_IMAGE=${DEBIAN_IMAGE:-kubetune/debian:bookworm}
KIND_BASE_IMAGE=${KIND_BASE_IMAGE:-kubetune/kind-base:$KIND_VERSION}
NODE_IMAGE=${NODE_IMAGE:-kubetune/kind-node:$KUBE_VERSION}
NETBASE_IMAGE=kubetune/kind-netbase:bookworm
# Bump when what goes into the node image changes; the node image's label holds it, the versions
# and a hash of this script and hack/kind-images/, and is rebuilt when that label differs.
RECIPE=1

CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kubetune"
KBIN="$CACHE/bin/node-$KUBE_VERSION"
XBIN="$CACHE/bin/kind-node"
WORK="$CACHE/work"
LOGS="$CACHE/logs/kind-node"
TMP="$CACHE/tmp/kind-node-image"

log() { echo "kind-node-image: $*" >&2; }
die() { echo "kind-node-image: $1" >&2; exit "${2:-1}"; }
need() { command -v "$1" >/dev/null 2>&1 || die "$1 not found on PATH ($2)" 2; }

need docker "install Docker, e.g. Debian's docker.io (hack/docker-engine.sh start installs it)"
need go "install Go 1.21 or newer"
need gcc "apt-get install gcc libc6-dev"
need python3 "install Python 3"
docker info >/dev/null 2>&1 ||
  die "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}): run hack/docker-engine.sh start" 2
docker image inspect "$DEBIAN_IMAGE" >/dev/null 2>&1 ||
  die "image $DEBIAN_IMAGE missing: run hack/base-image.sh" 2

export GOMODCACHE="${GOMODCACHE:-$CACHE/go/mod}" GOCACHE="${GOCACHE:-$CACHE/go/build}"
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}" CGO_ENABLED=0 GOWORK=off GO111MODULE=on
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-modcacherw"
JOBS=${KUBETUNE_BUILD_JOBS:-$(n=$(nproc); echo $((n < 4 ? n : 4)))}
export DOCKER_BUILDKIT=0   # the docker CLI here has no buildx; the legacy builder it is

mkdir -p "$KBIN" "$XBIN" "$WORK" "$LOGS" "$TMP"
exec 9>"$TMP.lock"
if ! flock -n 9; then
  log "waiting for another build of the node image ..."
  flock 9
fi

t_start=$(date +%s)
elapsed() { echo "$(($(date +%s) - t_start))s"; }

# run_logged LABEL LOGNAME CMD...: run with output to a log; on failure show its tail.
run_logged() {
  local label=$1 name=$2 start rc=0
  shift 2
  start=$(date +%s)
  "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    log "$label FAILED (exit $rc); last lines of $LOGS/$name.log:"
    tail -n 30 "$LOGS/$name.log" >&2
    exit 1
  fi
  log "$label: $(($(date +%s) - start))s"
}

# ---------------------------------------------------------------------------------------------
# kind's source (for its base image files, default manifests and image tags)
# ---------------------------------------------------------------------------------------------
kind_src=$(go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" 2>>"$LOGS/download.log" |
  sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p') || true
[ -d "${kind_src:-/nonexistent}/pkg/build/nodeimage" ] ||
  die "cannot fetch sigs.k8s.io/kind@$KIND_VERSION from the Go module proxy (see $LOGS/download.log)"

# The value of a Go string constant `const NAME = "..."` in kind's nodeimage package.
kind_const() {
  sed -n "s/^const $1 = \"\\(.*\\)\"\$/\\1/p" "$kind_src"/pkg/build/nodeimage/*.go | head -n1
}
# A raw-string manifest constant of kind's nodeimage package, with its image constants expanded.
kind_manifest() {
  local text name
  text=$(awk -v start="const $1 = \`" 'index($0, start) == 1 {on = 1; next} on && $0 == "`" {exit} on {print}' \
    "$kind_src/pkg/build/nodeimage/$2")
  for name in kindnetdImage storageProvisionerImage storageHelperImage; do
    text=${text//"\` + $name + \`"/$(kind_const "$name")}
  done
  printf '%s\n' "$text"
}
KINDNETD_IMAGE=$(kind_const kindnetdImage)
LOCAL_PATH_IMAGE=$(kind_const storageProvisionerImage)
LOCAL_PATH_HELPER_IMAGE=$(kind_const storageHelperImage)
dockerfile_arg() { sed -n "s/^ARG $1=\"\\(.*\\)\"\$/\\1/p" "$kind_src/images/base/Dockerfile" | head -n1; }
CONTAINERD_VERSION=${CONTAINERD_VERSION:-$(dockerfile_arg CONTAINERD_VERSION)}
CNI_PLUGINS_VERSION=${CNI_PLUGINS_VERSION:-$(dockerfile_arg CNI_PLUGINS_VERSION)}
CRICTL_VERSION=${CRICTL_VERSION:-$(dockerfile_arg CRICTL_VERSION)}
SANDBOX_IMAGE=$(sed -n 's/^[[:space:]]*sandbox_image = "\(.*\)"/\1/p' "$kind_src/images/base/files/etc/containerd/config.toml")
if [ -z "$KINDNETD_IMAGE" ] || [ -z "$LOCAL_PATH_IMAGE" ] || [ -z "$LOCAL_PATH_HELPER_IMAGE" ] ||
  [ -z "$SANDBOX_IMAGE" ] || [ -z "$CONTAINERD_VERSION" ] || [ -z "$CNI_PLUGINS_VERSION" ] ||
  [ -z "$CRICTL_VERSION" ]; then
  die "cannot read the image names from kind $KIND_VERSION's source ($kind_src)"
fi

fingerprint=$(cat "$ROOT/hack/kind-node-image.sh" "$ROOT"/hack/kind-images/* | sha256sum | cut -c1-12)
NODE_LABEL="$KUBE_VERSION-$KIND_VERSION-r$RECIPE-$fingerprint"
node_image_current() {
  [ "${FORCE:-0}" != 1 ] &&
    [ "$(docker image inspect -f '{{ index .Config.Labels "io.kubetune.kind-node.recipe" }}' "$NODE_IMAGE" 2>/dev/null)" = "$NODE_LABEL" ]
}
if node_image_current; then
  log "$NODE_IMAGE is up to date"
  echo "$NODE_IMAGE"
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# Binaries
# ---------------------------------------------------------------------------------------------
log "Kubernetes $KUBE_VERSION binaries -> $KBIN"
if [ "$KUBE_VERSION" != "$(PYTHONPATH="$ROOT/dev/src" python3 -c 'from kubetune_dev.binaries import KUBERNETES_VERSION as v; print(v)')" ]; then
  die "KUBE_VERSION=$KUBE_VERSION differs from KUBERNETES_VERSION in dev/src/kubetune_dev/binaries.py" 2
fi
cp_dir=$(PYTHONPATH="$ROOT/dev/src" python3 -m kubetune_dev.binaries build) ||
  die "the control-plane build (python -m kubetune_dev.binaries build) failed"
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl etcd; do
  if ! cmp -s "$cp_dir/$b" "$KBIN/$b"; then
    cp "$cp_dir/$b" "$KBIN/.$b.partial" && mv -f "$KBIN/.$b.partial" "$KBIN/$b"
  fi
done

# kubeadm, kubelet, kube-proxy: in a wrapper module whose go.mod is the one the project's
# build generated for k8s.io/kubernetes (staging modules replaced by their published releases).
kwork="$WORK/kind-node-$KUBE_VERSION"
mkdir -p "$kwork"
sed 's#^module .*#module kubetune.local/build/kind-node#' "$WORK/kubernetes-$KUBE_VERSION/go.mod" >"$kwork/go.mod.new"
cmp -s "$kwork/go.mod.new" "$kwork/go.mod" || { mv -f "$kwork/go.mod.new" "$kwork/go.mod"; cp "$WORK/kubernetes-$KUBE_VERSION/go.sum" "$kwork/go.sum"; }
rm -f "$kwork/go.mod.new"
release_date=$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$GOMODCACHE/cache/download/k8s.io/kubernetes/@v/$KUBE_VERSION.info")
kube_ldflags=$(PYTHONPATH="$ROOT/dev/src" python3 -c \
  'import sys; from kubetune_dev.binaries import kubernetes_ldflags as f; print(" ".join(f(sys.argv[1], sys.argv[2])))' \
  "$KUBE_VERSION" "${release_date:-1970-01-01T00:00:00Z}")
for b in kubeadm kubelet kube-proxy; do
  [ -x "$KBIN/$b" ] && continue
  (cd "$kwork" && run_logged "go build $b" "build-$b" \
    go build -p "$JOBS" -mod=mod -trimpath -ldflags "-s -w $kube_ldflags" -o "$KBIN/.$b.partial" "k8s.io/kubernetes/cmd/$b")
  mv -f "$KBIN/.$b.partial" "$KBIN/$b"
done

# go_module_build NAME MODULE VERSION TAGS LDFLAGS PKG...: build commands of MODULE@VERSION into
# $XBIN/NAME-VERSION/ through a wrapper module (upstream's go, godebug and exclude directives
# copied: `go install pkg@version` refuses modules with exclude or replace directives).
go_module_build() {
  local name=$1 module=$2 version=$3 tags=$4 ldflags=$5 out gomod wd missing=0 p
  shift 5
  out="$XBIN/$name-$version"
  for p in "$@"; do [ -x "$out/${p##*/}" ] || missing=1; done
  [ "$missing" = 1 ] || return 0
  gomod=$(go mod download -json "$module@$version" 2>>"$LOGS/download.log" |
    sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p') || true
  [ -f "$gomod" ] || die "cannot fetch $module@$version from the Go module proxy (see $LOGS/download.log)"
  wd="$WORK/kind-node-$name-$version"
  mkdir -p "$wd"
  {
    echo "module kubetune.local/build/$name"
    echo
    grep -E '^(go|godebug) ' "$gomod" || true
    echo
    echo "require $module $version"
    echo
    awk '/^exclude \(/ {on = 1} on {print} on && /^\)/ {on = 0}' "$gomod"
  } >"$wd/go.mod.new"
  cmp -s "$wd/go.mod.new" "$wd/go.mod" || { mv -f "$wd/go.mod.new" "$wd/go.mod"; rm -f "$wd/go.sum"; }
  rm -f "$wd/go.mod.new"
  rm -rf "$out.partial" && mkdir -p "$out.partial"
  (cd "$wd" && run_logged "go build $name $version" "build-$name" \
    go build -p "$JOBS" -mod=mod -trimpath -tags "$tags" -ldflags "-s -w $ldflags" -o "$out.partial/" "$@")
  rm -rf "$out" && mv "$out.partial" "$out"
}

COREDNS_TAG="" ETCD_TAG="" PAUSE_TAG=""
while read -r image; do
  case "$image" in
    */coredns:*) COREDNS_TAG=${image##*:} ;;
    */etcd:*) ETCD_TAG=${image##*:} ;;
    */pause:*) PAUSE_TAG=${image##*:} ;;
  esac
done < <("$KBIN/kubeadm" config images list --kubernetes-version "$KUBE_VERSION")
if [ -z "$COREDNS_TAG" ] || [ -z "$ETCD_TAG" ] || [ -z "$PAUSE_TAG" ]; then
  die "cannot read the coredns, etcd and pause tags from kubeadm config images list"
fi

log "node components -> $XBIN"
ctrd=github.com/containerd/containerd/v2
go_module_build containerd "$ctrd" "$CONTAINERD_VERSION" "no_btrfs no_devmapper no_zfs" \
  "-X $ctrd/version.Version=$CONTAINERD_VERSION -X $ctrd/version.Package=$ctrd" \
  "$ctrd/cmd/containerd" "$ctrd/cmd/ctr" "$ctrd/cmd/containerd-shim-runc-v2"
go_module_build cri-tools sigs.k8s.io/cri-tools "$CRICTL_VERSION" "" \
  "-X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" sigs.k8s.io/cri-tools/cmd/crictl
cni=github.com/containernetworking/plugins
go_module_build cni-plugins "$cni" "$CNI_PLUGINS_VERSION" "" "" \
  "$cni/plugins/ipam/host-local" "$cni/plugins/main/loopback" "$cni/plugins/main/ptp" "$cni/plugins/meta/portmap"
go_module_build coredns github.com/coredns/coredns "$COREDNS_TAG" "" "" github.com/coredns/coredns
go_module_build local-path-provisioner github.com/rancher/local-path-provisioner "$LOCAL_PATH_VERSION" "" \
  "-X main.VERSION=$LOCAL_PATH_VERSION" github.com/rancher/local-path-provisioner
pause_dir="$XBIN/pause-$PAUSE_TAG"
if ! [ -x "$pause_dir/pause" ] || [ "$ROOT/hack/kind-images/pause.c" -nt "$pause_dir/pause" ]; then
  mkdir -p "$pause_dir"
  gcc -static -O2 -s -o "$pause_dir/.pause.partial" "$ROOT/hack/kind-images/pause.c" 2>"$LOGS/build-pause.log" ||
    die "gcc -static failed (is libc6-dev installed?): $(tail -n 5 "$LOGS/build-pause.log")" 2
  mv -f "$pause_dir/.pause.partial" "$pause_dir/pause"
fi

# ---------------------------------------------------------------------------------------------
# Component images
# ---------------------------------------------------------------------------------------------
# drop_if_dangling ID: remove an image this script replaced, once no tag points at it.
drop_if_dangling() {
  if [ -n "$1" ] && [ "$(docker image inspect -f '{{ len .RepoTags }}' "$1" 2>/dev/null)" = 0 ]; then
    docker rmi "$1" >/dev/null 2>&1 || true
  fi
}
# image_build TAG CTX [EXTRA_TAG...]: docker build CTX (with CTX/Dockerfile); the builder's
# layer cache makes this a second or two when nothing changed (FORCE=1: --no-cache).
image_build() {
  local tag=$1 ctx=$2 extra old nocache=()
  shift 2
  [ "${FORCE:-0}" != 1 ] || nocache=(--no-cache)
  old=$(docker image inspect -f '{{ .Id }}' "$tag" 2>/dev/null || true)
  run_logged "docker build $tag" "image-${tag//[\/:]/_}" docker build "${nocache[@]}" --pull=false -t "$tag" "$ctx"
  for extra in "$@"; do docker tag "$tag" "$extra"; done
  drop_if_dangling "$old"
}
# ctx NAME DOCKERFILE-TEXT FILE...: a fresh build context with the given files (hard links).
ctx() {
  local dir="$TMP/ctx/$1" text=$2 f
  shift 2
  rm -rf "$dir" && mkdir -p "$dir"
  printf '%s\n' "$text" >"$dir/Dockerfile"
  for f in "$@"; do ln "$f" "$dir/" 2>/dev/null || cp "$f" "$dir/"; done
  echo "$dir"
}

log "component images"
image_build "$NETBASE_IMAGE" "$(ctx netbase "FROM $DEBIAN_IMAGE
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
      iptables ipset conntrack iproute2 kmod curl jq ca-certificates \\
    && apt-get clean && rm -rf /var/lib/apt/lists/*")"
for b in kube-apiserver kube-controller-manager kube-scheduler; do
  image_build "registry.k8s.io/$b:$KUBE_VERSION" "$(ctx "$b" "FROM $DEBIAN_IMAGE
COPY $b /usr/local/bin/$b" "$KBIN/$b")"
done
image_build "registry.k8s.io/kube-proxy:$KUBE_VERSION" "$(ctx kube-proxy "FROM $NETBASE_IMAGE
COPY kube-proxy /usr/local/bin/kube-proxy" "$KBIN/kube-proxy")"
image_build "registry.k8s.io/etcd:$ETCD_TAG" "$(ctx etcd "FROM $DEBIAN_IMAGE
COPY etcd /usr/local/bin/etcd" "$KBIN/etcd")"
image_build "registry.k8s.io/coredns/coredns:$COREDNS_TAG" "$(ctx coredns "FROM $DEBIAN_IMAGE
COPY coredns /coredns
ENTRYPOINT [\"/coredns\"]" "$XBIN/coredns-$COREDNS_TAG/coredns")"
image_build "registry.k8s.io/pause:$PAUSE_TAG" "$(ctx pause "FROM scratch
COPY pause /pause
USER 65535:65535
ENTRYPOINT [\"/pause\"]" "$pause_dir/pause")" "$SANDBOX_IMAGE"
image_build "$KINDNETD_IMAGE" "$(ctx kindnetd "FROM $NETBASE_IMAGE
COPY kindnetd.sh /bin/kindnetd
ENTRYPOINT [\"/bin/kindnetd\"]" "$ROOT/hack/kind-images/kindnetd.sh")"
image_build "$LOCAL_PATH_IMAGE" "$(ctx local-path-provisioner "FROM $DEBIAN_IMAGE
COPY local-path-provisioner /usr/local/bin/local-path-provisioner
ENTRYPOINT [\"/usr/local/bin/local-path-provisioner\"]" \
  "$XBIN/local-path-provisioner-$LOCAL_PATH_VERSION/local-path-provisioner")"
# The helper pod runs kind's setup/teardown scripts with sh, mkdir and rm: Debian has them.
docker tag "$DEBIAN_IMAGE" "$LOCAL_PATH_HELPER_IMAGE"

# ---------------------------------------------------------------------------------------------
# kind's base image
# ---------------------------------------------------------------------------------------------
log "base image $KIND_BASE_IMAGE"
bctx="$TMP/ctx/base"
rm -rf "$bctx" && mkdir -p "$bctx/bin" "$bctx/cni"
cp -r "$kind_src/images/base/files" "$bctx/files"
chmod -R u+w "$bctx/files"
find "$bctx/files" -type f -exec chmod 0644 {} + && chmod 0755 "$bctx"/files/kind/bin/* "$bctx"/files/usr/local/bin/*
cp "$XBIN/containerd-$CONTAINERD_VERSION"/* "$XBIN/cri-tools-$CRICTL_VERSION/crictl" "$bctx/bin/"
cp "$XBIN/cni-plugins-$CNI_PLUGINS_VERSION"/* "$bctx/cni/"
cp "$ROOT/hack/kind-images/base.Dockerfile" "$bctx/Dockerfile"
image_build "$KIND_BASE_IMAGE" "$bctx"

# ---------------------------------------------------------------------------------------------
# The node image: what kind's `build node-image` does (pkg/build/nodeimage/buildcontext.go), with
# every image loaded from local archives instead of pulled.
# ---------------------------------------------------------------------------------------------
images=(
  "registry.k8s.io/kube-apiserver:$KUBE_VERSION" "registry.k8s.io/kube-controller-manager:$KUBE_VERSION"
  "registry.k8s.io/kube-scheduler:$KUBE_VERSION" "registry.k8s.io/kube-proxy:$KUBE_VERSION"
  "registry.k8s.io/etcd:$ETCD_TAG" "registry.k8s.io/coredns/coredns:$COREDNS_TAG"
  "registry.k8s.io/pause:$PAUSE_TAG" "$SANDBOX_IMAGE"
  "$KINDNETD_IMAGE" "$LOCAL_PATH_IMAGE" "$LOCAL_PATH_HELPER_IMAGE"
)
log "node image $NODE_IMAGE"
build_id="kind-node-build-$$"
cleanup() {
  docker rm -f -v "$build_id" >/dev/null 2>&1 || true
  rm -f "$TMP/images.tar"
}
trap cleanup EXIT
run_logged "docker save (${#images[@]} images)" save-images docker save -o "$TMP/images.tar" "${images[@]}"
docker run -d --name "$build_id" --entrypoint=sleep --security-opt seccomp=unconfined \
  "$KIND_BASE_IMAGE" infinity >/dev/null
in_node() { docker exec "$build_id" "$@"; }
for b in kubeadm kubelet kubectl; do
  docker cp "$KBIN/$b" "$build_id:/usr/bin/$b"
  in_node chmod +x "/usr/bin/$b"
  in_node chown root:root "/usr/bin/$b"
done
in_node mkdir -p /kind/manifests
printf '%s' "$KUBE_VERSION" | docker exec -i "$build_id" tee /kind/version >/dev/null
kind_manifest defaultCNIManifest const_cni.go | docker exec -i "$build_id" tee /kind/manifests/default-cni.yaml >/dev/null
kind_manifest defaultStorageManifest const_storage.go | docker exec -i "$build_id" tee /kind/manifests/default-storage.yaml >/dev/null
in_node bash -c 'nohup containerd >/dev/null 2>&1 &'
# shellcheck disable=SC2016 # expanded in the container
in_node bash -c 'for i in $(seq 1 30); do [ -S /run/containerd/containerd.sock ] && break; sleep 1; done; ctr info >/dev/null' ||
  die "containerd did not start in the build container"
docker exec -i "$build_id" ctr --namespace=k8s.io images import --label=io.cri-containerd.pinned=pinned \
  --all-platforms --no-unpack --digests - <"$TMP/images.tar" >"$LOGS/import.log" 2>&1 ||
  { tail -n 20 "$LOGS/import.log" >&2; die "ctr images import failed"; }
imported=$(in_node ctr --namespace=k8s.io images list -q)
for image in "${images[@]}"; do
  first=${image%%/*}
  case "$image" in
    */*) case "$first" in *.* | *:* | localhost) full=$image ;; *) full="docker.io/$image" ;; esac ;;
    *) full="docker.io/library/$image" ;;
  esac
  grep -qxF "$full" <<<"$imported" || die "$full missing from the node's containerd after the import; it has: $imported"
done
in_node pkill containerd || true
# shellcheck disable=SC2016 # expanded in the container
# (containerd's parent in the build container is `sleep`, which leaves it a zombie: not running)
in_node bash -c 'for i in $(seq 1 20); do ps -C containerd -o stat= | grep -qv "^Z" || exit 0; sleep 0.5; done; exit 1' ||
  log "warning: containerd still running in the build container at commit time"
old_node=$(docker image inspect -f '{{ .Id }}' "$NODE_IMAGE" 2>/dev/null || true)
docker commit \
  --change 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]' \
  --change 'ENV HTTP_PROXY="" HTTPS_PROXY="" NO_PROXY=""' \
  --change "LABEL io.kubetune.kind-node.recipe=$NODE_LABEL" \
  "$build_id" "$NODE_IMAGE" >/dev/null
drop_if_dangling "$old_node"
log "built $NODE_IMAGE in $(elapsed) ($(docker image inspect -f '{{ .Size }}' "$NODE_IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}'))"
echo "$NODE_IMAGE"
