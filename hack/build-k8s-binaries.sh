#!/usr/bin/env bash
# Build (or locate, when already cached) the local control-plane binaries used by the
# integration tests: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
# kwok and helm, compiled from the Go module proxy. Versions are pinned in
# dev/src/kubetune_dev/binaries.py; see docs/control-plane-build.md.
#
#   hack/build-k8s-binaries.sh            # build what is missing, print the bin dir
#   hack/build-k8s-binaries.sh path       # print the bin dir only
#   hack/build-k8s-binaries.sh versions   # pinned versions and what the binaries report
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ -n "${PYTHON:-}" ]]; then
  python="${PYTHON}"
elif [[ -x "${repo_root}/.venv/bin/python" ]]; then
  python="${repo_root}/.venv/bin/python"
else
  python="$(command -v python3)"
fi

# The module is pure standard library: running it from the source tree needs no install.
export PYTHONPATH="${repo_root}/dev/src${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1

if [[ $# -eq 0 ]]; then
  set -- build
fi
exec "${python}" -m kubetune_dev.binaries "$@"
