"""Plain HTTPS to a local kube-apiserver, for tests that want the raw REST API."""

from __future__ import annotations

import http.client
import json
import ssl
from typing import Any

from kubetune_dev.cluster import ADMIN, LocalCluster


class Api:
    """Plain HTTPS to the kube-apiserver with the admin client certificate, keep-alive."""

    def __init__(self, local: LocalCluster) -> None:
        cert, key = local.pki.client(ADMIN)
        self.ctx = ssl.create_default_context(cafile=str(local.pki.ca_cert))
        self.ctx.load_cert_chain(str(cert), str(key))
        self.port = local.state.apiserver_port
        self._conn: http.client.HTTPSConnection | None = None

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
            if self._conn is None:
                self._conn = self.connect()
            try:
                headers = {"Accept": "application/json"}
                if body is not None:
                    headers["Content-Type"] = content_type
                self._conn.request(method, path, body=body, headers=headers)
                response = self._conn.getresponse()
                data = response.read()
            except (http.client.HTTPException, OSError):
                self._conn.close()
                self._conn = None
                if attempt == 2:
                    raise
                continue
            try:
                return response.status, json.loads(data) if data else None
            except ValueError:
                return response.status, data.decode(errors="replace")
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
