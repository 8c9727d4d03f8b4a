"""A minimal dynamic provisioner for the local cluster: hostPath volumes for PVCs.

For every Pending PVC of our StorageClass it creates a hostPath PersistentVolume under
`--volumes`, pre-bound to the claim through `claimRef`, with the claim's access modes
(ReadWriteOnce and ReadWriteMany alike: on one machine both are honest). Released volumes
are deleted with their folders. Test and demo infrastructure only.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from lightkube import Client, KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.core_v1 import (
    HostPathVolumeSource,
    ObjectReference,
    PersistentVolumeSpec,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import PersistentVolume, PersistentVolumeClaim

PROVISIONED_BY = "kubetune.io/local-provisioner"


def pv_for_claim(
    claim: PersistentVolumeClaim, volumes: Path, storage_class: str
) -> PersistentVolume:
    meta = claim.metadata
    assert meta is not None and claim.spec is not None
    name = f"pvc-{meta.uid}"
    path = volumes / name
    request = "1Gi"
    if claim.spec.resources and claim.spec.resources.requests:
        request = str(claim.spec.resources.requests.get("storage", request))
    return PersistentVolume(
        metadata=ObjectMeta(
            name=name, annotations={"pv.kubernetes.io/provisioned-by": PROVISIONED_BY}
        ),
        spec=PersistentVolumeSpec(
            capacity={"storage": request},
            accessModes=claim.spec.accessModes or ["ReadWriteOnce"],
            persistentVolumeReclaimPolicy="Delete",
            storageClassName=storage_class,
            hostPath=HostPathVolumeSource(path=str(path), type="DirectoryOrCreate"),
            claimRef=ObjectReference(
                apiVersion="v1",
                kind="PersistentVolumeClaim",
                name=meta.name,
                namespace=meta.namespace,
                uid=meta.uid,
            ),
        ),
    )


def sync_once(client: Client, volumes: Path, storage_class: str) -> int:
    """Provision what is pending and clean up what was released; returns actions taken."""
    actions = 0
    for claim in client.list(PersistentVolumeClaim, namespace="*"):
        spec, status = claim.spec, claim.status
        if spec is None or spec.storageClassName != storage_class or spec.volumeName:
            continue
        if status is not None and status.phase not in (None, "Pending"):
            continue
        pv = pv_for_claim(claim, volumes, storage_class)
        assert pv.spec is not None and pv.spec.hostPath is not None
        folder = Path(pv.spec.hostPath.path)
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)  # trainer pods run as a non-root user
        try:
            client.create(pv)
            actions += 1
        except ApiError as exc:
            if exc.status.code != 409:
                raise
    for pv in client.list(PersistentVolume):
        meta = pv.metadata
        annotations = (meta.annotations if meta else None) or {}
        if annotations.get("pv.kubernetes.io/provisioned-by") != PROVISIONED_BY:
            continue
        released = pv.status is not None and pv.status.phase == "Released"
        if released and meta and meta.name:
            if pv.spec and pv.spec.hostPath:
                shutil.rmtree(pv.spec.hostPath.path, ignore_errors=True)
            with contextlib.suppress(ApiError):
                client.delete(PersistentVolume, meta.name)
            actions += 1
    return actions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--volumes", required=True, type=Path)
    parser.add_argument("--storage-class", default="kubetune-local")
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args(argv)
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    client = Client(config=KubeConfig.from_file(args.kubeconfig))
    args.volumes.mkdir(parents=True, exist_ok=True)
    while not stop:
        try:
            sync_once(client, args.volumes, args.storage_class)
        except Exception as exc:  # keep serving; the apiserver may be restarting
            print(f"provisioner: {exc}", file=sys.stderr, flush=True)
        time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
