"""The benchmark's own client of the API server: HTTPS with the kubeconfig's client
certificate and kept-alive connections, every request it makes counted (so a run can take
them out of the API server's counters), and a LIST-then-WATCH thread."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from benchmarks.measure import RequestKey, parse_request_totals
from benchmarks.operator_scale.accounting import OwnKey


class OwnRequests:
    """The requests this benchmark made, by (verb, resource, subresource)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[OwnKey] = Counter()

    def add(self, key: OwnKey) -> None:
        with self._lock:
            self._counts[key] += 1

    def snapshot(self) -> Counter[OwnKey]:
        with self._lock:
            return Counter(self._counts)


class Api:
    """HTTPS to the API server with the kubeconfig's client certificate; one connection per
    thread, kept alive."""

    def __init__(self, kubeconfig: Path, own: OwnRequests) -> None:
        config = yaml.safe_load(kubeconfig.read_text())
        context = _named(config["contexts"], config["current-context"])["context"]
        cluster = _named(config["clusters"], context["cluster"])["cluster"]
        user = _named(config["users"], context["user"])["user"]
        server = urlsplit(cluster["server"])
        self.host, self.port = server.hostname or "127.0.0.1", server.port or 443
        self.ssl = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.ssl.load_cert_chain(user["client-certificate"], user["client-key"])
        self.own = own
        self._local = threading.local()

    def connect(self, timeout: float | None = 60.0) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.ssl, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        key: OwnKey | None,
        body: bytes | None = None,
        accept: str = "application/json",
        content_type: str = "application/json",
    ) -> tuple[int, bytes]:
        headers = {"Accept": accept, "User-Agent": "kubetune-operator-scale-benchmark"}
        if body is not None:
            headers["Content-Type"] = content_type
        for attempt in (1, 2):
            conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self.connect()
            try:
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            if key is not None:
                self.own.add(key)
            return response.status, data
        raise AssertionError("unreachable")

    def get_json(self, path: str, key: OwnKey) -> dict[str, Any]:
        status, data = self.request("GET", path, key)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {data[:300]!r}")
        return dict(json.loads(data))

    def metrics_text(self) -> str:
        # /metrics itself is not counted in apiserver_request_total: no own key.
        status, data = self.request("GET", "/metrics", None, accept="text/plain")
        if status != 200:
            raise RuntimeError(f"GET /metrics: HTTP {status}: {data[:300]!r}")
        return data.decode(errors="replace")

    def request_totals(self, text: str | None = None) -> dict[RequestKey, float]:
        text = self.metrics_text() if text is None else text
        wanted = "\n".join(x for x in text.splitlines() if x.startswith("apiserver_request_total{"))
        return parse_request_totals(wanted)


def _named(entries: Iterable[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    for entry in entries:
        if entry.get("name") == name:
            return entry
    raise KeyError(f"the kubeconfig has no entry named {name!r}")


class Watch(threading.Thread):
    """LIST then WATCH a collection, handing every object to `on_event`; re-lists when the
    watch's resource version expires."""

    def __init__(
        self,
        api: Api,
        path: str,
        resource: str,
        on_event: Callable[[str, Mapping[str, Any]], None],
    ) -> None:
        super().__init__(name=f"watch-{resource}", daemon=True)
        self.api, self.path, self.resource, self.on_event = api, path, resource, on_event
        self.synced = threading.Event()
        self.errors = 0
        self._stopping = threading.Event()
        self._conn: http.client.HTTPSConnection | None = None

    def run(self) -> None:
        version: str | None = None
        while not self._stopping.is_set():
            try:
                if version is None:
                    data = self.api.get_json(self.path, ("LIST", self.resource, ""))
                    for item in data.get("items") or []:
                        self.on_event("ADDED", item)
                    version = str(data["metadata"]["resourceVersion"])
                    self.synced.set()
                version = self._stream(version)
            except (OSError, http.client.HTTPException, ValueError, RuntimeError, KeyError):
                if self._stopping.is_set():
                    return
                self.errors += 1
                version = None
                time.sleep(1.0)

    def _stream(self, version: str) -> str | None:
        sep = "&" if "?" in self.path else "?"
        path = (
            f"{self.path}{sep}watch=1&allowWatchBookmarks=true"
            f"&resourceVersion={version}&timeoutSeconds=300"
        )
        conn = self._conn = self.api.connect(timeout=None)
        try:
            conn.request("GET", path, headers={"Accept": "application/json"})
            self.api.own.add(("WATCH", self.resource, ""))
            response = conn.getresponse()
            if response.status != 200:
                response.read()
                return None
            while True:
                line = response.readline()
                if not line:
                    return version
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # 410 Gone: the version is too old; list again
                    return None
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind != "BOOKMARK":
                    self.on_event(str(kind), obj)
        finally:
            conn.close()

    def stop(self) -> None:
        self._stopping.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
