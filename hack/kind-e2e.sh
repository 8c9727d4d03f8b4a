#!/usr/bin/env bash
# The e2e suite against a kind cluster: the trainer trains in real containers under a real
# kubelet, the operator runs as a pod installed by `helm install`, checkpoints and data land on
# volumes of one host folder mounted into every node (ReadWriteMany, kubetune-shared).
#
#   hack/kind-e2e.sh            # create the cluster, build + load images, install, test, delete
#   KEEP=1 hack/kind-e2e.sh     # leave the cluster running afterwards
#   hack/kind-e2e.sh --if-cached  # the same, but only where an earlier run left the images
#                                 # (else print SKIPPED and why, exit 0): what `make test` runs
#   KIND_PASSED_FILE=F            # once the suite passed, write its pytest arguments to F
#
# Two ways to get the images:
#   KIND_IMAGES=local (default)  nothing is pulled from any registry: a Docker engine of the
#       project's own is started if none answers (hack/docker-engine.sh), kind is built from the
#       Go module proxy (hack/build-kind.sh), the Debian base images are debootstrapped
#       (hack/base-image.sh), the node image is built from Go modules (hack/kind-node-image.sh),
#       and kubectl/helm come from the local control plane's build (python -m
#       kubetune_dev.binaries). Each step is cached under ~/.cache/kubetune; see
#       docs/kind-images.md for the cold and warm times.
#   KIND_IMAGES=upstream  a host with a registry: kind's own node image (or KIND_NODE_IMAGE),
#       the Dockerfiles' default base images, and docker, kind, kubectl and helm from PATH.
#
# Other settings: KIND_NODE_IMAGE (node image; local default: kubetune/kind-node:v1.37.1),
# KIND_VERSION (local: v0.33.0), OPERATOR_BASE_IMAGE / TRAINER_BASE_IMAGE (the Dockerfiles'
# BASE_IMAGE; local defaults: kubetune/python:bookworm / kubetune/debian:bookworm),
# DOCKER_BUILD_ARGS (extra arguments for both `docker build`s). Arguments are passed to pytest.
# Exit code 2 means a prerequisite is missing; the message says which.
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${KIND_CLUSTER_NAME:-kubetune-e2e}
OPERATOR_IMAGE=${OPERATOR_IMAGE:-kubetune/operator:e2e}
TRAINER_IMAGE=${TRAINER_IMAGE:-kubetune/trainer:e2e}
KIND_IMAGES=${KIND_IMAGES:-local}
VENV=${VENV:-.venv}
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kubetune"
READY="$CACHE/kind-e2e.ready"  # written once the local images have been built here
MIN_FREE_GB=${KIND_MIN_FREE_GB:-30}  # the trainer image (6.4 GB) unpacked in two nodes, and more
IF_CACHED=0
if [ "${1:-}" = --if-cached ]; then IF_CACHED=1; shift; fi
WORK=$(mktemp -d)
KUBECONFIG_FILE="$WORK/kubeconfig"
# Mounted into every node at /var/kubetune-shared: the StorageClass kubetune-shared
# (hack/kind-shared-storage.yaml) makes its ReadWriteMany volumes there.
SHARED_DIR="$WORK/shared"

stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
need() { command -v "$1" >/dev/null 2>&1 || { echo "kind-e2e: $1 not found on PATH ($2)" >&2; exit 2; }; }
skip() { echo "kind-e2e: SKIPPED, the kind e2e suite did not run: $1"; rm -rf "$WORK"; exit 0; }
# GB free under the engine's data root ($root_dir, set once the engine answers).
free_gb() { echo $(( $(df -Pk "$root_dir" 2>/dev/null | awk 'NR == 2 {print $4}') / 1048576 )); }
# Too little disk: skip with why under --if-cached, else fail with why (exit 2).
short_of_disk() {
  [ "$IF_CACHED" = 1 ] && skip "$1"
  echo "kind-e2e: $1" >&2
  exit 2
}
t0=$(date +%s)
if [ ! -x "$VENV/bin/pytest" ]; then
  [ "$IF_CACHED" = 1 ] && { echo "kind-e2e: $VENV/bin/pytest missing: run make setup" >&2; exit 2; }
  stamp "creating the project's virtualenv $VENV (make setup)"
  make setup VENV="$VENV"
fi

# Set to 1 (with an EXIT trap calling stop_engine) when this script starts the engine.
started_engine=0
stop_engine() { [ "$started_engine" = 1 ] && [ "${KEEP:-0}" != 1 ] && hack/docker-engine.sh stop || true; }

if [ "$IF_CACHED" = 1 ]; then
  [ "$KIND_IMAGES" = local ] || skip "--if-cached needs KIND_IMAGES=local"
  [ -s "$READY" ] || skip "no kind images built on this machine yet ($READY missing). A cold \
build and run takes about 30 minutes; run hack/kind-e2e.sh once and later runs of make test include it"
  docker info >/dev/null 2>&1 || command -v dockerd >/dev/null 2>&1 ||
    skip "no Docker engine here and dockerd is not installed"
fi

case "$KIND_IMAGES" in
  local)
    stamp "engine, kind, kubectl, helm, base and node images (cached under ~/.cache/kubetune)"
    if ! docker info >/dev/null 2>&1; then
      hack/docker-engine.sh start
      started_engine=1
      trap stop_engine EXIT
    fi
    if [ "$IF_CACHED" = 1 ]; then
      # shellcheck disable=SC2046
      docker image inspect $(cat "$READY") >/dev/null 2>&1 ||
        skip "the engine no longer holds every image listed in $READY"
    fi
    KIND_VERSION=${KIND_VERSION:-v0.33.0}
    KIND_BIN=$(KIND_VERSION=$KIND_VERSION hack/build-kind.sh)
    PATH="$(dirname "$KIND_BIN"):$("$VENV/bin/python" -m kubetune_dev.binaries build):$PATH"
    hack/base-image.sh python
    KIND_NODE_IMAGE=${KIND_NODE_IMAGE:-$(KIND_VERSION=$KIND_VERSION hack/kind-node-image.sh)}
    OPERATOR_BASE_IMAGE=${OPERATOR_BASE_IMAGE:-kubetune/python:bookworm}
    TRAINER_BASE_IMAGE=${TRAINER_BASE_IMAGE:-kubetune/debian:bookworm}
    mkdir -p "$CACHE"
    echo "$KIND_NODE_IMAGE $OPERATOR_BASE_IMAGE $TRAINER_BASE_IMAGE" >"$READY"
    stamp "prerequisites ready in $(( $(date +%s) - t0 ))s"
    ;;
  upstream) ;;
  *) echo "kind-e2e: KIND_IMAGES=$KIND_IMAGES: use local or upstream" >&2; exit 2 ;;
esac
need docker "install Docker, e.g. Debian's docker.io"
need kind "go install sigs.k8s.io/kind@v0.33.0"
need kubectl "any recent kubectl"
need helm "go install helm.sh/helm/v4/cmd/helm@latest or a helm release"
docker info >/dev/null 2>&1 || { echo "kind-e2e: no Docker engine answers on this machine" >&2; exit 2; }
# A cluster of that name left by an earlier run (KEEP=1, or a run that was killed) is replaced.
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  stamp "deleting the cluster $CLUSTER left by an earlier run"
  kind delete cluster --name "$CLUSTER"
fi
root_dir=$(docker info --format '{{.DockerRootDir}}' 2>/dev/null || echo /)
free=$(free_gb)
[ "$free" -ge "$MIN_FREE_GB" ] || short_of_disk "only ${free} GB free under $root_dir; the \
cluster needs about ${MIN_FREE_GB} GB (the trainer image unpacked in two nodes); free some \
space or set KIND_MIN_FREE_GB"

cleanup() {
  if [ "${KEEP:-0}" = 1 ]; then
    echo "cluster kept: export KUBECONFIG=$KUBECONFIG_FILE; delete with: kind delete cluster --name $CLUSTER"
  else
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
  stop_engine
}
trap cleanup EXIT


# Build the images while nothing else runs: both builds are cached by layer, so a rebuild after
# a code change only redoes the project's own layers. Their build stages are tagged too
# (…-build:e2e), or the pruning below would take them as dangling and the next run would
# build llama.cpp again.
stamp "building images"
built=("$OPERATOR_IMAGE" "$TRAINER_IMAGE" "${OPERATOR_IMAGE%:*}-build:e2e" "${TRAINER_IMAGE%:*}-build:e2e")
replaced=$(docker image inspect --format '{{.Id}}' "${built[@]}" 2>/dev/null || true)
# shellcheck disable=SC2086
docker build ${DOCKER_BUILD_ARGS:-} ${OPERATOR_BASE_IMAGE:+--build-arg BASE_IMAGE="$OPERATOR_BASE_IMAGE"} \
  -f operator/Dockerfile --target build -t "${OPERATOR_IMAGE%:*}-build:e2e" .
# shellcheck disable=SC2086
docker build ${DOCKER_BUILD_ARGS:-} ${TRAINER_BASE_IMAGE:+--build-arg BASE_IMAGE="$TRAINER_BASE_IMAGE"} \
  -f trainer_image/Dockerfile --target llama-cpp -t "${TRAINER_IMAGE%:*}-build:e2e" .
# shellcheck disable=SC2086
docker build ${DOCKER_BUILD_ARGS:-} ${OPERATOR_BASE_IMAGE:+--build-arg BASE_IMAGE="$OPERATOR_BASE_IMAGE"} \
  -f operator/Dockerfile -t "$OPERATOR_IMAGE" .
# shellcheck disable=SC2086
docker build ${DOCKER_BUILD_ARGS:-} ${TRAINER_BASE_IMAGE:+--build-arg BASE_IMAGE="$TRAINER_BASE_IMAGE"} \
  -f trainer_image/Dockerfile -t "$TRAINER_IMAGE" .

# Each rebuild of the trainer image leaves the previous one dangling (6.4 GB where its
# dependency layer changed); they are never used again, and a machine that runs this often
# fills its disk with them. In the project's own engine (hack/docker-engine.sh, under
# ~/.cache/kubetune) every dangling image goes, those of earlier runs too; in any other
# engine only the images these builds replaced. Tagged images (base, node, kind's own) stay.
case "$root_dir" in
  "$CACHE"/*) docker image prune --force >/dev/null ;;
  *)
    for id in $replaced; do
      [ "$(docker image inspect --format '{{len .RepoTags}}' "$id" 2>/dev/null)" = 0 ] &&
        docker rmi "$id" >/dev/null 2>&1 || true
    done
    ;;
esac
# What the cluster will take: the trainer image unpacked in each worker, once more while one
# import is in flight (its layers are discarded after unpacking), and the nodes themselves.
trainer_gb=$(( ($(docker image inspect --format '{{.Size}}' "$TRAINER_IMAGE") + 1073741823) / 1073741824 ))
need_gb=$(( 3 * trainer_gb + 4 ))
free=$(free_gb)
stamp "disk: ${free} GB free under $root_dir, the cluster needs about ${need_gb} GB (trainer image ${trainer_gb} GB)"
[ "$free" -ge "$need_gb" ] || short_of_disk "only ${free} GB free under $root_dir after building \
the images; the cluster needs about ${need_gb} GB (the ${trainer_gb} GB trainer image unpacked in \
two workers, and one import in flight); free some space"

stamp "creating kind cluster $CLUSTER (one control plane, two workers as GPU pools local-cpu, local-cpu-b)"
# failCgroupV1: false lets kubelet run on hosts still on cgroup v1 (it changes nothing on v2).
# restrict_oom_score_adj: where the engine lacks CAP_SYS_RESOURCE nothing in the nodes may
# lower oom_score_adj; containerd then clamps what kubelet asks for (harmless elsewhere).
# The same host directory in every node: a filesystem the nodes share, for ReadWriteMany.
mkdir -p "$SHARED_DIR"
cat >"$WORK/kind.yaml" <<YAML
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    extraMounts:
      - {hostPath: $SHARED_DIR, containerPath: /var/kubetune-shared}
  - role: worker
    labels:
      kubetune.io/pool: local-cpu
    extraMounts:
      - {hostPath: $SHARED_DIR, containerPath: /var/kubetune-shared}
  - role: worker
    labels:
      kubetune.io/pool: local-cpu-b
    extraMounts:
      - {hostPath: $SHARED_DIR, containerPath: /var/kubetune-shared}
kubeadmConfigPatches:
  - |
    kind: KubeletConfiguration
    failCgroupV1: false
containerdConfigPatches:
  - |-
    [plugins."io.containerd.grpc.v1.cri"]
      restrict_oom_score_adj = true
YAML
kind create cluster --name "$CLUSTER" --config "$WORK/kind.yaml" --kubeconfig "$KUBECONFIG_FILE" \
  --wait 180s ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
export KUBECONFIG="$KUBECONFIG_FILE"
# Each worker stands in for a GPU node (pools local-cpu and local-cpu-b): the pool's taint, and
# two simulated nvidia.com/gpu (an extended resource advertised by hand, as a device plugin
# would). Work runs on the CPU.
for worker in "$CLUSTER-worker" "$CLUSTER-worker2"; do
  kubectl taint node "$worker" nvidia.com/gpu=true:NoSchedule --overwrite
  kubectl patch node "$worker" --subresource=status --type=json \
    -p '[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"2"}]'
done

# The operator (and nothing else) runs on the control plane.
kubectl taint node "$CLUSTER-control-plane" node-role.kubernetes.io/control-plane:NoSchedule- || true

stamp "StorageClass kubetune-shared (ReadWriteMany: the cache, checkpoint and data claims)"
# A second local-path provisioner with kind's own images, on the directory the nodes share.
lpp_image=$(kubectl -n local-path-storage get deployment local-path-provisioner \
  -o jsonpath='{.spec.template.spec.containers[0].image}')
lpp_helper=$(kubectl -n local-path-storage get configmap local-path-config \
  -o jsonpath='{.data.helperPod\.yaml}' | sed -n 's/^ *image: *//p' | head -n1)
[ -n "$lpp_image" ] && [ -n "$lpp_helper" ] ||
  { echo "kind-e2e: cannot read kind's local-path-provisioner images" >&2; exit 1; }
sed -e "s|@PROVISIONER_IMAGE@|$lpp_image|g" -e "s|@HELPER_IMAGE@|$lpp_helper|g" \
  hack/kind-shared-storage.yaml | kubectl apply -f -
kubectl -n local-path-storage rollout status deployment/kubetune-shared-path-provisioner --timeout=120s

stamp "loading images into the nodes"
# The trainer image (several GB of CUDA torch) only where trainer pods run: the workers. Not
# `kind load`: its import keeps every layer twice in a node (the blob in containerd's content
# store and the unpacked snapshot); --discard-unpacked-layers (which needs --local: ctr imports
# in its own process) lets containerd drop the blobs once unpacked, as its CRI does for
# pulled images when configured to.
for worker in "$CLUSTER-worker" "$CLUSTER-worker2"; do
  docker save "$TRAINER_IMAGE" | docker exec --privileged -i "$worker" \
    ctr --namespace=k8s.io images import --digests --snapshotter=overlayfs --local \
    --discard-unpacked-layers - >/dev/null
done
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE"

stamp "helm install"
# The release namespace enforces the restricted Pod Security Standard, as the e2e namespace
# does (tests/support/e2e_targets.py): the operator's pod and the `helm test` pod must pass it.
kubectl create namespace kubetune-system
kubectl label namespace kubetune-system pod-security.kubernetes.io/enforce=restricted
# The cache and checkpoint claims (ReadWriteMany) on kubetune-shared: a checkpoint volume
# follows its job to any node, and the pods of a two-node plan share it. Stage-in pods run the trainer image, which
# only the workers hold: they go to the first pool's node and tolerate its taint. Trainer
# pods get 2Gi of host memory per GPU, request = limit as in production (a CPU worker of the
# tiny model takes about 1Gi): the host-memory fault reaches that limit for real.
helm install kubetune charts/kubetune --namespace kubetune-system --wait \
  --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="${OPERATOR_IMAGE##*:}" \
  --set image.pullPolicy=Never \
  --set operator.trainerImage="$TRAINER_IMAGE" --set operator.trainerImagePullPolicy=Never \
  --set operator.pollSeconds=1 --set operator.queueRetrySeconds=2 \
  --set operator.progressWriteSeconds=1 \
  --set operator.terminationGraceSeconds=60 --set operator.rescheduleSeconds=5 \
  --set operator.trainerCPUPerGPU=250m --set operator.trainerMemoryPerGPU=2Gi \
  --set operator.allowTestFaults=true --set operator.startupTimeoutSeconds=90 \
  --set operator.cacheStorageClass=kubetune-shared \
  --set operator.checkpointStorageClass=kubetune-shared --set operator.checkpointReadWriteMany=true \
  --set operator.stageInCPU=250m --set operator.stageInMemory=1Gi \
  --set operator.exportCPU=250m --set operator.exportMemory=1Gi \
  --set-json 'operator.stageInNodeSelector={"kubetune.io/pool":"local-cpu"}' \
  --set-json 'operator.stageInTolerations=[{"key":"nvidia.com/gpu","operator":"Exists","effect":"NoSchedule"}]' \
  --set 'operator.allowedTrainerImages={localhost/kubetune-missing:0}'

stamp "helm test"
helm test kubetune --namespace kubetune-system --logs --timeout 3m

stamp "running the e2e suite against kind"
KUBETUNE_E2E_TARGET=kind KUBETUNE_KIND_KUBECONFIG="$KUBECONFIG_FILE" KIND_CLUSTER_NAME="$CLUSTER" \
  KUBETUNE_KIND_SHARED_DIR="$SHARED_DIR" \
  KUBETUNE_KIND_TRAINER_IMAGE="$TRAINER_IMAGE" "$VENV/bin/pytest" tests/e2e -m e2e "$@"
stamp "kind e2e passed in $(( $(date +%s) - t0 ))s"
# `make test` leaves the scenarios that passed here out of the local target's run.
if [ -n "${KIND_PASSED_FILE:-}" ]; then echo "$*" >"$KIND_PASSED_FILE"; fi
