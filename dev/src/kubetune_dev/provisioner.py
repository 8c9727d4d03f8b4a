"""A minimal dynamic provisioner for the local cluster: hostPath volumes for PVCs.

For every Pending PVC of our StorageClass it creates a hostPath PersistentVolume under
`--volumes`, pre-bound to the claim through `claimRef`, with the claim's access modes
(ReadWriteOnce and ReadWriteMany alike: on one machine both are honest). Released volumes
are deleted with their folders. Test and demo infrastructure only.

Claims of the class `<class>-sized` get a tmpfs of exactly their request mounted on their
folder: a file system that really fills up, for disk-full drills. Mounting needs the right to
(root, or CAP_SYS_ADMIN); where it is refused the claim stays Pending and the provisioner's
log says why.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
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
SIZED_SUFFIX = "-sized"
"""The class `<class>-sized`: each volume a tmpfs of the claim's request."""
_TMPFS_UNITS = {"": "", "Ki": "k", "Mi": "m", "Gi": "g", "k": "000", "M": "000000"}


def tmpfs_size(request: str) -> str:
    """A claim's storage request as tmpfs's `size=` option (`64Mi` → `64m`)."""
    m = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|k|M)?", request.strip())
    if m is None:
        raise ValueError(f"a sized volume needs a whole Ki/Mi/Gi/k/M request, not {request!r}")
    return m.group(1) + _TMPFS_UNITS[m.group(2) or ""]


def _mount_tmpfs(folder: Path, request: str) -> None:
    subprocess.run(
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={tmpfs_size(request)},mode=0777",
            "tmpfs",
            str(folder),
        ],
        check=True,
        capture_output=True,
        text=True,
    )


def _unmount(folder: Path) -> None:
    """Unmount a sized volume's tmpfs (nothing for a plain folder)."""
    if os.path.ismount(folder):
        subprocess.run(["umount", "-l", str(folder)], check=False, capture_output=True)


def unmount_volumes(volumes: Path) -> None:
    """Unmount the sized volumes under `volumes` (before the folder is removed)."""
    if volumes.is_dir():
        for folder in volumes.iterdir():
            _unmount(folder)


def _remove(folder: Path) -> None:
    """A volume's folder, unmounted first where it is a sized volume's tmpfs."""
    _unmount(folder)
    shutil.rmtree(folder, ignore_errors=True)


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
    sized = storage_class + SIZED_SUFFIX
    for claim in client.list(PersistentVolumeClaim, namespace="*"):
        spec, status = claim.spec, claim.status
        if spec is None or spec.storageClassName not in (storage_class, sized):
            continue
        if spec.volumeName or (status is not None and status.phase not in (None, "Pending")):
            continue
        pv = pv_for_claim(claim, volumes, spec.storageClassName)
        assert pv.spec is not None and pv.spec.hostPath is not None
        folder = Path(pv.spec.hostPath.path)
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)  # trainer pods run as a non-root user
        if spec.storageClassName == sized and not os.path.ismount(folder):
            assert pv.spec.capacity is not None
            try:
                _mount_tmpfs(folder, str(pv.spec.capacity["storage"]))
            except (ValueError, OSError, subprocess.CalledProcessError) as exc:
                detail = getattr(exc, "stderr", "") or exc
                print(f"provisioner: cannot make {folder} a sized volume: {detail}", flush=True)
                continue
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
                _remove(Path(pv.spec.hostPath.path))
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
