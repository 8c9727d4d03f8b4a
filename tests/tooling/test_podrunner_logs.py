"""The pod runner's container-log endpoint (what `kubectl logs` reaches through the API
server): tails, byte limits, following a container until it exits, and the errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from kubetune_dev.podrunner.logserver import LogServer, exited_marker, tail_offset


@pytest.mark.parametrize(
    ("text", "lines", "expected"),
    [
        (b"a\nb\nc\n", 2, b"b\nc\n"),
        (b"a\nb\nc", 2, b"b\nc"),  # the last line has no newline yet
        (b"a\nb\nc\n", 5, b"a\nb\nc\n"),
        (b"a\nb\nc\n", 0, b""),
        (b"", 3, b""),
    ],
)
def test_tail_offset_finds_the_last_lines(
    tmp_path: Path, text: bytes, lines: int, expected: bytes
) -> None:
    path = tmp_path / "log"
    path.write_bytes(text)
    assert text[tail_offset(path, lines) :] == expected


def test_tail_offset_crosses_read_blocks(tmp_path: Path) -> None:
    path = tmp_path / "log"
    lines = [f"{i:06d}".encode() * 3000 + b"\n" for i in range(40)]  # ~18 KB each
    path.write_bytes(b"".join(lines))
    assert path.read_bytes()[tail_offset(path, 7) :] == b"".join(lines[-7:])


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[LogServer, Path]]:
    pod_dir = tmp_path / "ns_pod"
    (pod_dir / ".podrunner").mkdir(parents=True)
    server = LogServer(tmp_path)
    server.start()
    try:
        yield server, pod_dir
    finally:
        server.stop()


def _get(server: LogServer, path: str, **params: str) -> httpx2.Response:
    return httpx2.get(f"http://127.0.0.1:{server.port}{path}", params=params, timeout=10)


def test_serves_a_container_log_with_tail_and_limit(served: tuple[LogServer, Path]) -> None:
    server, pod_dir = served
    (pod_dir / "main.log").write_bytes(b"one\ntwo\nthree\n")
    assert _get(server, "/containerLogs/ns/pod/main").text == "one\ntwo\nthree\n"
    assert _get(server, "/containerLogs/ns/pod/main", tailLines="1").text == "three\n"
    assert _get(server, "/containerLogs/ns/pod/main", limitBytes="5").text == "one\nt"


def test_follow_streams_until_the_container_exits(served: tuple[LogServer, Path]) -> None:
    server, pod_dir = served
    log = pod_dir / "main.log"
    log.write_bytes(b"first\n")

    def write_then_exit() -> None:
        time.sleep(0.5)
        with log.open("ab") as f:
            f.write(b"second\n")
        time.sleep(0.5)
        with log.open("ab") as f:
            f.write(b"last\n")
        exited_marker(pod_dir, "main").write_text("0")

    writer = threading.Thread(target=write_then_exit)
    # Read the clock before the writer starts: its 1 s of sleeps all come after it.
    started = time.monotonic()
    writer.start()
    answer = _get(server, "/containerLogs/ns/pod/main", follow="true")
    writer.join()
    assert answer.text == "first\nsecond\nlast\n"
    assert time.monotonic() - started >= 1.0  # it waited for the writes, not just the file


def test_errors_say_what_is_missing(served: tuple[LogServer, Path]) -> None:
    server, pod_dir = served
    (pod_dir / "main.log").write_bytes(b"x\n")
    missing = _get(server, "/containerLogs/ns/pod/other")
    assert missing.status_code == 404 and 'container "other"' in missing.text
    assert _get(server, "/containerLogs/ns/../etc").status_code == 404
    assert _get(server, "/containerLogs/ns/pod/main", previous="true").status_code == 400
    assert _get(server, "/containerLogs/ns/pod/main", tailLines="x").status_code == 400
