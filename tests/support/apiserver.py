"""Plain HTTPS to a local kube-apiserver, for tests that want the raw REST API, and the
tiers' reads of objects by kubectl's names for them (`get("pvc", name, namespace)`).

A read here costs the API server what `kubectl get -o json` costs it, and this process a
fraction of a millisecond where kubectl costs a process start, its kubeconfig and its
discovery cache each time: the tiers poll objects every half second while the trainer and the
operator share the same two cores."""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

from kubetune_dev.cluster import ADMIN, LocalCluster


@dataclass(frozen=True)
class Resource:
    """Where the API server serves a kind: `/api/v1` or `/apis/GROUP/VERSION`, its plural."""

    prefix: str
    plural: str
    namespaced: bool

    def path(self, namespace: str | None, name: str | None = None) -> str:
        path = self.prefix
        if self.namespaced and namespace:
            path += f"/namespaces/{urllib.parse.quote(namespace)}"
        path += f"/{self.plural}"
        return path + (f"/{urllib.parse.quote(name)}" if name is not None else "")


RESOURCES: dict[str, Resource] = {}
"""kubectl's names for the kinds the tiers read (singular, plural, short name, kind.group)."""


def _serve(prefix: str, plural: str, namespaced: bool, *names: str) -> None:
    for name in names:
        RESOURCES[name] = Resource(prefix, plural, namespaced)


_serve("/api/v1", "pods", True, "pod", "pods", "po")
_serve("/api/v1", "nodes", False, "node", "nodes", "no")
_serve("/api/v1", "namespaces", False, "namespace", "namespaces", "ns")
_serve("/api/v1", "configmaps", True, "configmap", "configmaps", "cm")
_serve("/api/v1", "services", True, "service", "services", "svc")
_serve("/api/v1", "events", True, "event", "events", "ev")
_serve(
    "/api/v1",
    "persistentvolumeclaims",
    True,
    "pvc",
    "persistentvolumeclaim",
    "persistentvolumeclaims",
)
_serve("/api/v1", "persistentvolumes", False, "pv", "persistentvolume", "persistentvolumes")
_serve("/apis/batch/v1", "jobs", True, "job", "jobs", "job.batch", "jobs.batch")
_serve("/apis/coordination.k8s.io/v1", "leases", True, "lease", "leases")
_serve(
    "/apis/kubetune.io/v1alpha1",
    "finetunejobs",
    True,
    "finetunejob",
    "finetunejobs",
    "ftj",
    "finetunejob.kubetune.io",
)
_serve(
    "/apis/kubetune.io/v1alpha1",
    "gpupools",
    False,
    "gpupool",
    "gpupools",
    "gpool",
    "gpupool.kubetune.io",
)


class Api:
    """Plain HTTPS to the kube-apiserver with the admin client certificate, keep-alive."""

    def __init__(self, local: LocalCluster) -> None:
        cert, key = local.pki.client(ADMIN)
        self.ctx = ssl.create_default_context(cafile=str(local.pki.ca_cert))
        self.ctx.load_cert_chain(str(cert), str(key))
        self.local = local
        self._local = threading.local()

    @property
    def port(self) -> int:
        """The API server's port (kept across its restarts, read when connecting)."""
        return self.local.state.apiserver_port

    def connect(self, timeout: float = 30.0) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(
            "127.0.0.1", self.port, context=self.ctx, timeout=timeout
        )

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        """One request on the kept-alive connection (reconnecting up to twice): the HTTP
        status and the decoded JSON body (the text when it is not JSON, None when empty)."""
        for attempt in range(3):
            conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self.connect()
            try:
                headers = {"Accept": "application/json"}
                if body is not None:
                    headers["Content-Type"] = content_type
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            try:
                return response.status, json.loads(data) if data else None
            except ValueError:
                return response.status, data.decode(errors="replace")
        raise AssertionError("unreachable")

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """What `kubectl get KIND NAME -n NAMESPACE -o json` prints; None when not found. A
        namespaced kind without a namespace is read in `default`, as kubectl does."""
        resource = RESOURCES[kind]
        status, body = self._read(resource.path(namespace or "default", name))
        return None if status == 404 else dict(body)

    def list(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[dict[str, Any]]:
        """The items `kubectl get KIND -o json` prints (in all namespaces without one), each
        with its apiVersion and kind as kubectl fills them in."""
        path = RESOURCES[kind].path(namespace)
        if selector:
            path += "?" + urllib.parse.urlencode({"labelSelector": selector})
        _, body = self._read(path)
        kind_of_items = str(body.get("kind", "")).removesuffix("List")
        return [
            {"apiVersion": body.get("apiVersion"), "kind": kind_of_items, **item}
            for item in body.get("items") or []
        ]

    def _read(self, path: str) -> tuple[int, Any]:
        try:
            status, body = self.request("GET", path)
        except (http.client.HTTPException, OSError) as exc:
            raise AssertionError(f"GET {path}: {exc}") from exc
        if status != 200 and status != 404:
            raise AssertionError(f"GET {path}: HTTP {status}: {body}")
        return status, body

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
