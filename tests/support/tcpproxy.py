"""A TCP forwarder that can be severed: a network partition between one client and a server.

`TcpProxy(("127.0.0.1", port))` listens on a free loopback port and forwards every
connection to the target, byte for byte (TLS passes through untouched). `sever()` closes the
listening socket and every open connection: established streams break and new connections
are refused, as when a node loses its network.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target = target
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._severed = False
        self.connections = 0
        threading.Thread(target=self._accept, name="tcpproxy-accept", daemon=True).start()

    @property
    def port(self) -> int:
        return self.address[1]

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # severed
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._severed:
                    client.close()
                    upstream.close()
                    return
                self._sockets |= {client, upstream}
                self.connections += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def sever(self) -> None:
        """Close the listener and every forwarded connection; new connections are refused."""
        with self._lock:
            self._severed = True
            sockets, self._sockets = self._sockets, set()
        # shutdown() wakes the thread blocked in accept(); close() alone would not.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *_: object) -> None:
        self.sever()
