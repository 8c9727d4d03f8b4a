"""The severable TCP forwarder that the failover drill puts between a replica and the API
server (tests/support/tcpproxy.py)."""

from __future__ import annotations

import socket
import threading

import pytest

from support.tcpproxy import TcpProxy

pytestmark = pytest.mark.tooling


def echo_server() -> tuple[socket.socket, int]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: _echo(c), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(1024):
            conn.sendall(data)


def test_forwards_until_severed_then_refuses() -> None:
    server, port = echo_server()
    try:
        with TcpProxy(("127.0.0.1", port)) as proxy:
            conn = socket.create_connection(proxy.address, timeout=5)
            conn.sendall(b"hello")
            assert conn.recv(1024) == b"hello"
            proxy.sever()
            # The open connection breaks ...
            try:
                conn.sendall(b"more")
                assert conn.recv(1024) == b""
            except OSError:
                pass
            conn.close()
            # ... and nothing new gets through.
            with pytest.raises(OSError):
                socket.create_connection(proxy.address, timeout=2)
            assert proxy.connections == 1
    finally:
        server.close()
