"""The runner's access to the API server: a small REST client and the `Lookup` it backs.

`Api` sends and returns plain dicts (auth and TLS from the kubeconfig, through lightkube's
HTTP client), enough for the few calls a kubelet makes: nodes, leases, pods and their status,
events, ConfigMaps, Secrets, claims and volumes, service-account tokens. `ApiLookup` answers
podspec.Lookup from it, turning what is missing or unbound into NotReady.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kubetune_dev.podrunner.podspec import NotReady


class ApiError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Api:
    """A small dict-in, dict-out REST client (auth and TLS from the kubeconfig via lightkube)."""

    def __init__(self, kubeconfig: str | Path, timeout: float = 10.0) -> None:
        import httpx2  # lightkube's HTTP client
        from lightkube.config.client_adapter import Client, ConnectionParams
        from lightkube.config.kubeconfig import KubeConfig

        config = KubeConfig.from_file(str(kubeconfig)).get()
        if config is None:
            raise ValueError(f"{kubeconfig} has no current context")
        self.server = str(config.cluster.server)
        self._http = Client(config, ConnectionParams(timeout=httpx2.Timeout(timeout)))

    def close(self) -> None:
        self._http.close()

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> Any:
        headers = {"Accept": "application/json"}
        content = None
        if body is not None:
            headers["Content-Type"] = content_type
            content = json.dumps(body)
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        resp = self._http.request(
            method, path, params=dict(params or {}), content=content, headers=headers, **extra
        )
        if resp.status_code >= 400:
            try:
                message = str(resp.json().get("message", resp.text))
            except ValueError:
                message = resp.text
            raise ApiError(resp.status_code, message)
        return resp.json() if resp.content else None

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return dict(self.call("GET", path))
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    def patch(
        self, path: str, body: Any, kind: str = "strategic", timeout: float | None = None
    ) -> Any:
        content_type = {
            "strategic": "application/strategic-merge-patch+json",
            "merge": "application/merge-patch+json",
        }[kind]
        return self.call("PATCH", path, body, content_type=content_type, timeout=timeout)


def ns_path(namespace: str, plural: str, name: str = "", group: str = "") -> str:
    base = f"/apis/{group}" if group else "/api/v1"
    path = f"{base}/namespaces/{quote(namespace)}/{plural}"
    return f"{path}/{quote(name)}" if name else path


class ApiLookup:
    """Lookup backed by the API server."""

    def __init__(self, api: Api, volumes_root: Path) -> None:
        self.api = api
        self.volumes_root = volumes_root

    def config_map(self, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = self.api.get(ns_path(namespace, "configmaps", name))
        if obj is None:
            return None
        data = {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}
        for k, v in (obj.get("binaryData") or {}).items():
            data[k] = base64.b64decode(v)
        return data

    def secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = self.api.get(ns_path(namespace, "secrets", name))
        if obj is None:
            return None
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}

    def claim_path(self, namespace: str, claim: str) -> str:
        pvc = self.api.get(ns_path(namespace, "persistentvolumeclaims", claim))
        if pvc is None:
            raise NotReady("FailedMount", f'persistentvolumeclaim "{claim}" not found')
        volume = (pvc.get("spec") or {}).get("volumeName")
        if not volume or (pvc.get("status") or {}).get("phase") != "Bound":
            raise NotReady("FailedMount", f'persistentvolumeclaim "{claim}" is not bound yet')
        pv = self.api.get(f"/api/v1/persistentvolumes/{quote(volume)}")
        if pv is None:
            raise NotReady("FailedMount", f'persistentvolume "{volume}" not found')
        spec = pv.get("spec") or {}
        for kind in ("hostPath", "local"):
            if spec.get(kind, {}).get("path"):
                return str(spec[kind]["path"])
        # A volume with no folder of its own on this machine (nfs, csi, ...) is simulated by
        # one under --volumes-root, kept across pods like the real volume would be.
        return str(self.volumes_root / volume)

    def token(self, pod: Mapping[str, Any], audience: str | None, expiration: int) -> str:
        meta = pod.get("metadata") or {}
        sa = str((pod.get("spec") or {}).get("serviceAccountName") or "default")
        spec: dict[str, Any] = {
            "expirationSeconds": max(expiration, 600),
            "boundObjectRef": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta.get("name"),
                "uid": meta.get("uid"),
            },
        }
        if audience:
            spec["audiences"] = [audience]
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        try:
            out = self.api.call(
                "POST",
                ns_path(str(meta.get("namespace")), "serviceaccounts", sa) + "/token",
                body,
            )
        except ApiError as exc:
            raise NotReady("FailedMount", f"service account token for {sa!r}: {exc}") from exc
        return str(out["status"]["token"])
