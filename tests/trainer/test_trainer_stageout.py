"""The stage-out step (`python -m kubetune_trainer.stageout`): a run's output folder uploaded to
a real S3 server (versitygw, support/s3server.py), with a small fault-injecting HTTP proxy in
front of it for the store's bad days.

What is pinned: every file under source_dir arrives under the prefix with its bytes and its
sha256 in the object's metadata; a file over part_bytes goes up as a multipart upload; the
manifest is written last and lists every file; a second run sends nothing; a rerun after an
object went missing (or a file changed) sends only that one, after deleting the stale
manifest; wrong keys and a missing bucket exit 2 at once with "To fix"; an empty or missing
output exits 2; 500s are retried, and a store that stays down ends the try as transient.

The tests need versitygw, built from Go modules on first use (about 2 minutes, then cached);
they are skipped, with the reason, where it cannot be built.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

pytest.importorskip("boto3", reason="the stage-out needs boto3 (the trainer extra)")

from kubetune_dev.cluster import free_port
from kubetune_trainer import hub as hub_module
from kubetune_trainer.contract import (
    CONTRACT_VERSION,
    EXIT_CONFIG_ERROR,
    UPLOAD_MANIFEST,
    StageOutResult,
)
from kubetune_trainer.stagein.fetch import S3_MAX_ATTEMPTS
from kubetune_trainer.stageout.__main__ import main
from support.s3server import S3Request, S3Server, s3_server
from support.trainer import worker_env

pytestmark = pytest.mark.trainer

MiB = 1024**2
PART_BYTES = 5 * MiB
BUCKET = "outputs"
WRITES = frozenset({"PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload"})


# ------------------------------------------------------------------ helpers


@pytest.fixture(autouse=True)
def _short_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_module, "RETRY_DELAYS_S", (0.05, 0.05, 0.05))


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """versitygw with an empty bucket `outputs` (skipped where versitygw cannot be built)."""
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        server.make_bucket(BUCKET)
        yield server


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    def use(*, endpoint: str | None = None, **keys: str) -> None:
        for key, value in s3.env(**keys).items():
            monkeypatch.setenv(key, value)
        if endpoint is not None:
            monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)

    use()
    return use


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run's output: an adapter whose weights (11 MiB) are over PART_BYTES, small files,
    a nested folder and an empty file."""
    root = tmp_path_factory.mktemp("output") / "output"
    files = {
        "adapter/adapter_config.json": json.dumps({"r": 8, "lora_alpha": 16}).encode(),
        "adapter/adapter_model.safetensors": os.urandom(11 * MiB + 12345),
        "tokenizer.json": b'{"model": {"type": "BPE"}}\n' * 200,
        "merged/shards/part 1.txt": b"a name with a space\n",
        "trainer_state/empty.log": b"",
    }
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def stageout_config(source: Path, prefix: str, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "contract_version": CONTRACT_VERSION,
        "job": {"name": "tune", "namespace": "team-a", "uid": "uid-1"},
        "source_dir": str(source),
        "destination": f"s3://{BUCKET}/{prefix}",
        "part_bytes": PART_BYTES,
    }
    cfg.update(extra)
    return cfg


def run_stageout(
    tmp: Path,
    cfg: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> tuple[int, str, list[dict[str, Any]]]:
    """`main` in this process: (exit code, termination message, the progress lines)."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "stageout.json"
    config.write_text(json.dumps(cfg))
    log = tmp / "termination-log"
    log.unlink(missing_ok=True)
    monkeypatch.setenv("KUBETUNE_TERMINATION_LOG", str(log))
    capsys.readouterr()
    code = main(["--config", str(config)])
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return code, log.read_text() if log.exists() else "", lines


def stored(s3: S3Server, prefix: str) -> dict[str, bytes]:
    """The objects under `prefix/`, by path relative to it."""
    client = s3.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/")
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    return {
        k.removeprefix(f"{prefix}/"): client.get_object(Bucket=BUCKET, Key=k)["Body"].read()
        for k in keys
    }


def writes(requests: list[S3Request], prefix: str) -> list[S3Request]:
    """The successful requests that wrote objects under `prefix/`, in order."""
    return [
        r
        for r in requests
        if r.operation in WRITES and r.ok and (r.key or "").startswith(f"{prefix}/")
    ]


def new_requests(s3: S3Server, before: int) -> list[S3Request]:
    return s3.requests()[before:]


# ------------------------------------------------------------------ uploads


def test_output_is_uploaded_large_files_in_parts_manifest_last(
    tmp_path: Path,
    s3: S3Server,
    s3_env: Callable[..., None],
    output: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prefix = "runs/first"
    before = len(s3.requests())
    code, message, lines = run_stageout(
        tmp_path, stageout_config(output, prefix), monkeypatch, capsys
    )
    assert code == 0, message
    result = StageOutResult.model_validate_json(message)
    local = tree(output)
    total = sum(len(b) for b in local.values())
    assert result == result.model_copy(
        update={
            "destination": f"s3://{BUCKET}/{prefix}",
            "files": len(local),
            "bytes": total,
            "uploaded_bytes": total,
            "skipped_bytes": 0,
        }
    )

    objects = stored(s3, prefix)
    manifest = json.loads(objects.pop(UPLOAD_MANIFEST))
    assert objects == local  # every file, byte for byte, nothing else
    assert manifest["files"] == [
        {"path": p, "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
        for p, b in sorted(local.items())
    ]
    assert manifest["job"] == {"name": "tune", "namespace": "team-a", "uid": "uid-1"}
    assert manifest["destination"] == f"s3://{BUCKET}/{prefix}"

    client = s3.client()
    for rel, data in local.items():
        head = client.head_object(Bucket=BUCKET, Key=f"{prefix}/{rel}")
        assert head["Metadata"] == {"sha256": hashlib.sha256(data).hexdigest()}, rel
    big = f"{prefix}/adapter/adapter_model.safetensors"
    assert client.head_object(Bucket=BUCKET, Key=big)["ETag"].strip('"').endswith("-3")

    done = writes(new_requests(s3, before), prefix)
    assert [r.operation for r in done if r.key == big].count("UploadPart") == 3
    small = {r.key for r in done if r.operation == "PutObject"}
    assert small == {f"{prefix}/{rel}" for rel in local if f"{prefix}/{rel}" != big} | {
        f"{prefix}/{UPLOAD_MANIFEST}"
    }
    assert done[-1].operation == "PutObject" and done[-1].key == f"{prefix}/{UPLOAD_MANIFEST}"

    assert sorted(line["file"] for line in lines) == sorted(local)
    assert not any(line["skipped"] for line in lines)
    assert lines[-1]["files_done"] == len(local) and lines[-1]["bytes_done"] == total


def test_a_second_run_sends_nothing(
    tmp_path: Path,
    s3: S3Server,
    s3_env: Callable[..., None],
    output: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prefix = "runs/twice"
    cfg = stageout_config(output, prefix)
    code, message, _ = run_stageout(tmp_path / "first", cfg, monkeypatch, capsys)
    assert code == 0, message
    first = StageOutResult.model_validate_json(message)

    before = len(s3.requests())
    code, message, lines = run_stageout(tmp_path / "second", cfg, monkeypatch, capsys)
    assert code == 0, message
    second = StageOutResult.model_validate_json(message)
    assert second.uploaded_bytes == 0
    assert second.skipped_bytes == second.bytes == first.bytes > 11 * MiB
    assert all(line["skipped"] for line in lines) and len(lines) == first.files
    # Only the manifest is written again; nothing is deleted.
    requests = new_requests(s3, before)
    assert [r.key for r in writes(requests, prefix)] == [f"{prefix}/{UPLOAD_MANIFEST}"]
    assert not [r for r in requests if r.operation == "DeleteObject"]


def test_a_rerun_sends_only_what_is_missing_or_changed(
    tmp_path: Path,
    s3: S3Server,
    s3_env: Callable[..., None],
    output: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = tmp_path / "output"
    for rel, data in tree(output).items():
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        (source / rel).write_bytes(data)
    prefix = "runs/again"
    cfg = stageout_config(source, prefix)
    code, message, _ = run_stageout(tmp_path / "first", cfg, monkeypatch, capsys)
    assert code == 0, message

    big = "adapter/adapter_model.safetensors"
    s3.client().delete_object(Bucket=BUCKET, Key=f"{prefix}/{big}")
    changed = source / "adapter" / "adapter_config.json"
    same_size = changed.read_bytes().replace(b"16", b"32")
    assert len(same_size) == changed.stat().st_size
    changed.write_bytes(same_size)

    before = len(s3.requests())
    code, message, lines = run_stageout(tmp_path / "second", cfg, monkeypatch, capsys)
    assert code == 0, message
    result = StageOutResult.model_validate_json(message)
    sent = (source / big).stat().st_size + len(same_size)
    assert result.uploaded_bytes == sent
    assert result.skipped_bytes == result.bytes - sent
    assert {line["file"] for line in lines if not line["skipped"]} == {
        big,
        "adapter/adapter_config.json",
    }

    requests = new_requests(s3, before)
    written = writes(requests, prefix)
    assert {r.key for r in written} == {
        f"{prefix}/{big}",
        f"{prefix}/adapter/adapter_config.json",
        f"{prefix}/{UPLOAD_MANIFEST}",
    }
    # The earlier manifest went before the first file was sent, the new one after the last.
    deleted = [
        i
        for i, r in enumerate(requests)
        if r.operation == "DeleteObject" and r.key == f"{prefix}/{UPLOAD_MANIFEST}"
    ]
    first_write = requests.index(written[0])
    assert len(deleted) == 1 and deleted[0] < first_write
    assert written[-1].key == f"{prefix}/{UPLOAD_MANIFEST}"
    objects = stored(s3, prefix)
    objects.pop(UPLOAD_MANIFEST)
    assert objects == tree(source)


# ------------------------------------------------------------------ permanent failures


def test_wrong_credentials_fail_at_once_with_what_to_fix(
    tmp_path: Path, s3: S3Server, output: Path
) -> None:
    """The real entry point, config from the environment, the production retry delays (5, 15,
    45 s): a refusal that were retried could not end within 30 seconds."""
    config = tmp_path / "stageout.json"
    config.write_text(json.dumps(stageout_config(output, "runs/refused")))
    log = tmp_path / "termination-log"
    env = worker_env(
        **s3.env(secret_key="not-the-secret-key"),
        KUBETUNE_STAGEOUT_CONFIG=str(config),
        KUBETUNE_TERMINATION_LOG=str(log),
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kubetune_trainer.stageout"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 30
    message = log.read_text()
    assert message.startswith(f"config_error output s3://{BUCKET}/runs/refused: S3 refused access")
    assert "SignatureDoesNotMatch" in message
    assert "To fix" in message and "write objects in bucket outputs" in message
    assert stored(s3, "runs/refused") == {}


def test_missing_bucket_is_permanent(
    tmp_path: Path,
    s3: S3Server,
    s3_env: Callable[..., None],
    output: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = stageout_config(output, "run", destination="s3://no-such-bucket/run")
    code, message, lines = run_stageout(tmp_path, cfg, monkeypatch, capsys)
    assert code == EXIT_CONFIG_ERROR
    assert message.startswith("config_error output s3://no-such-bucket/run: there is no bucket")
    assert "To fix: check the bucket in output.uri" in message
    assert lines == []


@pytest.mark.parametrize("what", ["empty", "missing"])
def test_nothing_to_upload_is_permanent(
    what: str,
    tmp_path: Path,
    s3: S3Server,
    s3_env: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = tmp_path / "output"
    if what == "empty":
        (source / "adapter").mkdir(parents=True)  # folders, no files
    before = len(s3.requests())
    code, message, _ = run_stageout(
        tmp_path, stageout_config(source, f"runs/{what}"), monkeypatch, capsys
    )
    assert code == EXIT_CONFIG_ERROR
    assert message.startswith(f"config_error output s3://{BUCKET}/runs/{what}: nothing to upload")
    assert str(source) in message and "To fix" in message
    assert new_requests(s3, before) == []  # the store is not asked


# ------------------------------------------------------------------ transient failures

INTERNAL_ERROR = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message></Error>"
)
HOP_BY_HOP = frozenset({"connection", "keep-alive", "expect", "transfer-encoding", "te"})


class FaultyStore:
    """An HTTP proxy in front of the S3 server that answers some requests with `500
    InternalError`, as S3 does on a bad day, and forwards the rest unchanged (the Host header
    included, which SigV4 signs): `fail_next` requests of any kind, `fail_parts` UploadPart
    requests, or every request while `down`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.fail_next = 0
        self.fail_parts = 0
        self.down = False
        self.failed: list[str] = []
        self.forwarded = 0
        self._lock = threading.Lock()
        store = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if store.fails(self.command, self.path):
                    self.send_response(500)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(INTERNAL_ERROR)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(INTERNAL_ERROR)
                    return
                status, headers, answer = store.forward(self.command, self.path, self.headers, body)
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in HOP_BY_HOP and (
                        key.lower() != "content-length" or self.command == "HEAD"
                    ):
                        self.send_header(key, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = handle_one

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def fails(self, method: str, path: str) -> bool:
        with self._lock:
            if self.down:
                fail = True
            elif self.fail_next > 0:
                self.fail_next -= 1
                fail = True
            elif self.fail_parts > 0 and method == "PUT" and "partNumber=" in path:
                self.fail_parts -= 1
                fail = True
            else:
                fail = False
            if fail:
                self.failed.append(f"{method} {path}")
            return fail

    def forward(
        self, method: str, path: str, headers: Any, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(
            self.upstream.hostname or "127.0.0.1", self.upstream.port, timeout=60
        )
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for key, value in headers.items():
                if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                    conn.putheader(key, value)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            response = conn.getresponse()
            answer = response.read()
            with self._lock:
                self.forwarded += 1
            return response.status, response.getheaders(), answer
        finally:
            conn.close()

    def __enter__(self) -> FaultyStore:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def faulty(s3: S3Server, s3_env: Callable[..., None]) -> Iterator[FaultyStore]:
    """The S3 server behind a `FaultyStore`, which AWS_ENDPOINT_URL names."""
    with FaultyStore(s3.endpoint) as store:
        s3_env(endpoint=store.endpoint)
        yield store


def test_server_errors_are_retried_until_the_upload_completes(
    tmp_path: Path,
    s3: S3Server,
    faulty: FaultyStore,
    output: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Seven 500s in a row outlast botocore's six requests of the first call, so the
    stage-out's own backoff takes over; two failed parts are retried within the transfer."""
    faulty.fail_next = 7
    faulty.fail_parts = 2
    prefix = "runs/flaky"
    code, message, _ = run_stageout(tmp_path, stageout_config(output, prefix), monkeypatch, capsys)
    assert code == 0, message
    result = StageOutResult.model_validate_json(message)
    assert result.uploaded_bytes == result.bytes > 11 * MiB
    assert len(faulty.failed) == 9
    assert sum("partNumber=" in f for f in faulty.failed) == 2
    assert "S3 error InternalError" in caplog.text and "try 2 of 4" in caplog.text
    objects = stored(s3, prefix)
    assert json.loads(objects.pop(UPLOAD_MANIFEST))["bytes"] == result.bytes
    assert objects == tree(output)


def test_a_store_that_stays_down_ends_the_try_as_transient(
    tmp_path: Path,
    s3: S3Server,
    faulty: FaultyStore,
    output: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    faulty.down = True
    prefix = "runs/down"
    t0 = time.monotonic()
    code, message, _ = run_stageout(tmp_path, stageout_config(output, prefix), monkeypatch, capsys)
    elapsed = time.monotonic() - t0
    assert code == 1
    assert message.startswith(f"transient output s3://{BUCKET}/{prefix}: failed 4 times")
    assert "InternalError" in message and "the pod is restarted" in message
    # 4 tries of the listing, each S3_MAX_ATTEMPTS + 1 requests: botocore's `max_attempts`
    # counts the retries after the first request.
    assert len(faulty.failed) == 4 * (S3_MAX_ATTEMPTS + 1) == 24
    assert faulty.forwarded == 0
    assert elapsed < 30
    faulty.down = False
    assert stored(s3, prefix) == {}


def test_an_unreachable_store_is_transient(
    tmp_path: Path,
    s3_env: Callable[..., None],
    output: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    s3_env(endpoint=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    code, message, _ = run_stageout(tmp_path, stageout_config(output, "run"), monkeypatch, capsys)
    assert code == 1
    assert message.startswith(f"transient output s3://{BUCKET}/run: failed 4 times")
    assert "Connection refused" in message
