"""The kubelet's container-log endpoint, for the pods this runner runs.

`kubectl logs` (and any client reading `pods/log`) asks the API server, which forwards to the
kubelet of the pod's node at `https://<InternalIP>:<daemonEndpoints.kubeletEndpoint.Port>
/containerLogs/<namespace>/<pod>/<container>`. This serves that path from the files the runner
writes (`WORK/<namespace>_<pod>/<container>.log`), with the kubelet's query parameters:

- `tailLines=N`: the last N lines; `limitBytes=N`: at most N bytes;
- `follow=true`: keep sending what the container writes until it exits (the runner leaves a
  `<container>.exited` marker) or the client goes away;
- `previous=true`: the runner never restarts a container, so there is no previous one (400,
  as a kubelet answers for a container that has not restarted).

`timestamps` and `sinceSeconds`/`sinceTime` are not supported (the runner keeps raw output,
not a CRI log with a time per line): they are ignored. It serves TLS with a certificate the
API server does not verify (the local control plane sets no `--kubelet-certificate-authority`)
and asks for no client certificate: test and demo infrastructure, listening on 127.0.0.1.
"""

from __future__ import annotations

import http.server
import logging
import ssl
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

PRIVATE_DIR = ".podrunner"
FOLLOW_POLL_SECONDS = 0.2
CHUNK = 64 * 1024
log = logging.getLogger("kubetune.podrunner")


def exited_marker(pod_dir: Path, container: str) -> Path:
    """The file the runner writes when a container's process has exited."""
    return pod_dir / PRIVATE_DIR / f"{container}.exited"


def tail_offset(path: Path, lines: int) -> int:
    """Byte offset of the start of the last `lines` lines of `path` (a last line without a
    newline counts as a line)."""
    size = path.stat().st_size
    if lines <= 0:
        return size
    with path.open("rb") as f:
        end = size
        found = 0
        # A trailing newline ends the last line; it does not start another one.
        f.seek(max(0, size - 1))
        if size and f.read(1) == b"\n":
            end -= 1
        pos = end
        while pos > 0:
            step = min(CHUNK, pos)
            pos -= step
            f.seek(pos)
            block = f.read(step)
            i = len(block)
            while True:
                i = block.rfind(b"\n", 0, i)
                if i < 0:
                    break
                found += 1
                if found == lines:
                    return pos + i + 1
    return 0


class _Handler(http.server.BaseHTTPRequestHandler):
    server: LogServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        log.debug("log server: " + format, *args)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        if len(parts) != 4 or parts[0] != "containerLogs" or any(".." in p for p in parts):
            self._error(404, f"not found: {url.path}")
            return
        _, namespace, pod, container = parts
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if query.get("previous") == "true":
            self._error(
                400, f'previous terminated container "{container}" in pod "{pod}" not found'
            )
            return
        pod_dir = self.server.work / f"{namespace}_{pod}"
        path = pod_dir / f"{container}.log"
        if not path.is_file():
            self._error(
                404, f'container "{container}" in pod "{pod}" has not started or has no log'
            )
            return
        try:
            tail = int(query["tailLines"]) if "tailLines" in query else None
            limit = int(query["limitBytes"]) if "limitBytes" in query else None
        except ValueError:
            self._error(400, "tailLines and limitBytes must be whole numbers")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        offset = tail_offset(path, tail) if tail is not None else 0
        follow = query.get("follow") == "true"
        try:
            self._stream(path, offset, limit, follow, exited_marker(pod_dir, container))
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass  # the client went away
        self.close_connection = True

    def _stream(
        self, path: Path, offset: int, limit: int | None, follow: bool, exited: Path
    ) -> None:
        sent = 0
        with path.open("rb") as f:
            f.seek(offset)
            while limit is None or sent < limit:
                done = exited.exists()  # before reading: what came before the exit is read
                block = f.read(CHUNK if limit is None else min(CHUNK, limit - sent))
                if block:
                    self._chunk(block)
                    sent += len(block)
                    continue
                if not follow or done or self.server.stopping.is_set() or not path.exists():
                    return
                time.sleep(FOLLOW_POLL_SECONDS)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _error(self, code: int, message: str) -> None:
        body = message.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class LogServer(http.server.ThreadingHTTPServer):
    """Serves `/containerLogs/...` from `work` on `host:port` (0: a free port), over TLS
    when given a certificate and key."""

    daemon_threads = True

    def __init__(
        self,
        work: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        cert: Path | None = None,
        key: Path | None = None,
    ) -> None:
        super().__init__((host, port), _Handler)
        self.work = work
        self.stopping = threading.Event()
        if cert is not None and key is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(cert), str(key))
            # The handshake happens in the request's thread, not in accept().
            self.socket = context.wrap_socket(
                self.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="log-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()
