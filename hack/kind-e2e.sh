#!/usr/bin/env bash
# The e2e suite against a kind cluster: the trainer trains in real containers under a real
# kubelet, the operator runs as a pod installed by `helm install`, checkpoints land on
# local-path volumes.
#
#   hack/kind-e2e.sh            # create the cluster, build + load images, install, test, delete
#   KEEP=1 hack/kind-e2e.sh     # leave the cluster running afterwards
#
# Needs: a running Docker engine, kind, kubectl and helm on PATH, and the project's
# virtualenv (make setup). KIND_NODE_IMAGE picks the node image (default: kind's own);
# DOCKER_BUILD_ARGS is passed to both `docker build`s (e.g. --build-arg BASE_IMAGE=...).
# Exit code 2 means a prerequisite is missing; the message says which.
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${KIND_CLUSTER_NAME:-kubetune-e2e}
OPERATOR_IMAGE=${OPERATOR_IMAGE:-kubetune/operator:e2e}
TRAINER_IMAGE=${TRAINER_IMAGE:-kubetune/trainer:e2e}
VENV=${VENV:-.venv}
WORK=$(mktemp -d)
KUBECONFIG_FILE="$WORK/kubeconfig"

need() { command -v "$1" >/dev/null 2>&1 || { echo "kind-e2e: $1 not found on PATH ($2)" >&2; exit 2; }; }
need docker "install Docker, e.g. Debian's docker.io"
need kind "go install sigs.k8s.io/kind@v0.31.0"
need kubectl "any recent kubectl"
need helm "go install helm.sh/helm/v4/cmd/helm@latest or a helm release"
docker info >/dev/null 2>&1 || { echo "kind-e2e: no Docker engine answers on this machine" >&2; exit 2; }
[ -x "$VENV/bin/pytest" ] || { echo "kind-e2e: $VENV/bin/pytest missing: run make setup" >&2; exit 2; }

stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
t0=$(date +%s)

cleanup() {
  if [ "${KEEP:-0}" = 1 ]; then
    echo "cluster kept: export KUBECONFIG=$KUBECONFIG_FILE; delete with: kind delete cluster --name $CLUSTER"
  else
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT

stamp "creating kind cluster $CLUSTER (one control plane, two workers as GPU pools local-cpu, local-cpu-b)"
cat >"$WORK/kind.yaml" <<YAML
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
  - role: worker
    labels:
      kubetune.io/pool: local-cpu
  - role: worker
    labels:
      kubetune.io/pool: local-cpu-b
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

stamp "building images"
# shellcheck disable=SC2086
docker build ${DOCKER_BUILD_ARGS:-} -f operator/Dockerfile -t "$OPERATOR_IMAGE" .
# shellcheck disable=SC2086
docker build ${DOCKER_BUILD_ARGS:-} -f trainer_image/Dockerfile -t "$TRAINER_IMAGE" .
stamp "loading images into the nodes"
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$TRAINER_IMAGE"

stamp "helm install"
helm install kubetune charts/kubetune --namespace kubetune-system --create-namespace --wait \
  --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="${OPERATOR_IMAGE##*:}" \
  --set image.pullPolicy=Never \
  --set operator.trainerImage="$TRAINER_IMAGE" --set operator.trainerImagePullPolicy=Never \
  --set operator.pollSeconds=1 --set operator.queueRetrySeconds=2 \
  --set operator.terminationGraceSeconds=60 --set operator.rescheduleSeconds=5

stamp "running the e2e suite against kind"
KUBETUNE_E2E_TARGET=kind KUBETUNE_KIND_KUBECONFIG="$KUBECONFIG_FILE" KIND_CLUSTER_NAME="$CLUSTER" \
  KUBETUNE_KIND_TRAINER_IMAGE="$TRAINER_IMAGE" "$VENV/bin/pytest" tests/e2e -m e2e "$@"
stamp "kind e2e passed in $(( $(date +%s) - t0 ))s"
