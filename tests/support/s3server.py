"""A real S3 server for the tests: versitygw over a temporary directory, on loopback unless
told another address of this machine (`s3_server(..., host=...)`, for pods of a kind cluster).

    with s3_server(tmp_path) as s3:
        s3.make_bucket("models")
        s3.put_tree("models", "tiny", model_dir)       # models/tiny/config.json, ...
        subprocess.run([...], env={**os.environ, **s3.env()})   # boto3 reads these natively
        assert s3.gets("models", "tiny/") == 3           # each file downloaded once
        s3.client(secret_key="wrong")                    # refused: 403 SignatureDoesNotMatch

The server is versitygw (github.com/versity/versitygw) v1.8.0 with its posix backend, built
from the Go module proxy and cached under ``~/.cache/kubetune/bin/versitygw-v1.8.0/`` by
`kubetune_dev.binaries.ensure_s3_server` (built on first use; `support.binaries` says so first).

Why versitygw rather than rclone v1.76.0 (``rclone serve s3``), the other S3 server the module
proxy serves:

- Build time. With an empty Go build cache versitygw compiles in 99 CPU-seconds (88 s wall
  on this 2-core machine when idle; 589 packages, a 43 MiB binary, 336 MB of modules to
  download), rclone in 186 CPU-seconds (155 s wall under load; it carries every one of its
  cloud backends: 271 required modules, 1.8 GB to download, an 83 MiB binary).
  docs/data.md, "Testing with a local S3 store", has the measurements.
- An access log made to be parsed: ``--access-log FILE`` writes one line per request in the
  AWS server-access-log format, with the S3 operation name (``s3_GetObject``,
  ``s3_HeadObject``, ``s3_UploadPart``...), bucket, key, status and error code, written
  synchronously before the answer goes out. rclone's ``serve s3`` only has its debug log.
- AWS's answers for the failures the tests need: with an IAM dir (``--iam-dir``, used here)
  an unknown access key is ``403 InvalidAccessKeyId`` and a wrong secret ``403
  SignatureDoesNotMatch``; a missing key is ``404 NoSuchKey``. (Without ``--iam-dir`` it runs in
  single-account mode, which answers an unknown key with ``404 XAdminUserNotFound``.)
- Multipart uploads, ranged GETs, ListObjectsV2 with prefix, delimiter and paging, and the
  flexible checksums boto3 >= 1.36 sends by default all work.

What the access log cannot tell: versitygw v1.8.0 logs 0 bytes sent and status 200 for every
GetObject (a streamed body and a 206 are not seen by its logger), so a download is counted by
requests, not bytes: `gets` counts GetObject requests that did not fail. A ranged download
(boto3's `download_file` above its multipart threshold) is one GET per range. The server's
stdout (``S3Server.log``, also the human-readable request log with real statuses) is there for
diagnosis.

Only path-style addressing is served (no ``--virtual-domain``): `client()` asks for it, and
botocore uses it anyway for an IP-address endpoint such as the one `env()` gives.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubetune_dev.cluster import free_port

ACCESS_KEY = "KUBETUNETESTKEY"
SECRET_KEY = "kubetune-test-secret-key-0123456789"
REGION = "us-east-1"

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

# owner bucket [time] remote-ip requester request-id operation key request-uri status error
# bytes-sent object-size total-ms turnaround-ms referer user-agent ... (AWS's server access log;
# versitygw writes the key unquoted, so it is the only field that may hold spaces, and the URI,
# which is percent-encoded, always starts with a slash).
_LINE_RE = re.compile(
    r"^(?P<owner>\S+) (?P<bucket>\S+) \[(?P<time>[^\]]*)\] (?P<ip>\S+) (?P<requester>\S+) "
    r"(?P<request_id>\S+) (?P<operation>\S+) (?P<key>.*?) (?P<uri>/\S*) (?P<status>\d{3}) "
    r"(?P<error>\S+) "
)


@dataclass(frozen=True)
class S3Request:
    """One line of the access log."""

    operation: str
    """The S3 API operation: ``GetObject``, ``HeadObject``, ``PutObject``, ``UploadPart``..."""
    bucket: str | None
    key: str | None
    status: int
    """The HTTP status, as versitygw logs it: 200 for every success (206 included)."""
    error: str | None
    """The S3 error code (``NoSuchKey``, ``SignatureDoesNotMatch``...), None on success."""
    requester: str | None
    """The access key the request was authenticated as; None when it was not."""
    uri: str
    time: str

    @property
    def ok(self) -> bool:
        return self.error is None and self.status < 300


def parse_access_line(line: str) -> S3Request | None:
    """An access-log line as an `S3Request`; None for other lines (``log starts ...``)."""
    m = _LINE_RE.match(line)
    if m is None:
        return None

    def field_or_none(name: str) -> str | None:
        value = m.group(name)
        return None if value == "-" else value

    return S3Request(
        operation=m.group("operation").removeprefix("s3_"),
        bucket=field_or_none("bucket"),
        key=field_or_none("key"),
        status=int(m.group("status")),
        error=field_or_none("error"),
        requester=field_or_none("requester"),
        uri=m.group("uri"),
        time=m.group("time"),
    )


@dataclass
class S3Server:
    """A running versitygw: where it listens, its credentials, its data and its logs."""

    endpoint: str
    """``http://127.0.0.1:PORT``"""
    access_key: str
    secret_key: str
    region: str
    data_dir: Path
    """The posix backend's root: one directory per bucket, one file per object."""
    access_log: Path
    log: Path
    """The server's stdout and stderr (its banner and a human-readable request log)."""
    process: subprocess.Popen[bytes] = field(repr=False)
    _log_offset: int = field(default=0, repr=False)

    def env(
        self, *, access_key: str | None = None, secret_key: str | None = None
    ) -> dict[str, str]:
        """What boto3 (and the AWS CLI and SDKs) read from the environment to talk to this
        server; pass wrong keys to get an environment the server refuses."""
        return {
            "AWS_ACCESS_KEY_ID": access_key or self.access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key or self.secret_key,
            "AWS_REGION": self.region,
            # botocore reads the region from AWS_DEFAULT_REGION; AWS_REGION is the SDKs' name.
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def client(self, *, access_key: str | None = None, secret_key: str | None = None) -> Any:
        """A boto3 S3 client for this server (path-style addressing); pass wrong keys for a
        client the server refuses (403 InvalidAccessKeyId / SignatureDoesNotMatch)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}),
        )

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def put_tree(self, bucket: str, prefix: str, local_dir: Path) -> list[str]:
        """Upload every file under `local_dir` to ``prefix/<relative path>`` (the whole
        bucket when `prefix` is empty); large files go up in parts. Returns the keys."""
        client = self.client()
        base = prefix.strip("/")
        keys: list[str] = []
        for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
            rel = path.relative_to(local_dir).as_posix()
            key = f"{base}/{rel}" if base else rel
            client.upload_file(str(path), bucket, key)
            keys.append(key)
        return keys

    def requests(self) -> list[S3Request]:
        """Every request since the server was ready, in the order it answered them."""
        with self.access_log.open("rb") as fh:
            fh.seek(self._log_offset)
            text = fh.read().decode(errors="replace")
        found = (parse_access_line(line) for line in text.splitlines())
        return [r for r in found if r is not None]

    def gets(self, bucket: str | None = None, prefix: str | None = None) -> int:
        """How many GetObject requests were answered with the object (refused and failed ones,
        403 and 404, are not counted; see `requests()`), in `bucket` under key `prefix`."""
        return sum(
            1
            for r in self.requests()
            if r.operation == "GetObject"
            and r.ok
            and (bucket is None or r.bucket == bucket)
            and (prefix is None or (r.key or "").startswith(prefix))
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"


def s3_server_binary_or_skip(say: Callable[[str], None] | None = None) -> Path:
    """The versitygw binary, built on first use; skips the calling test (with the reason) when
    it has to be built and there is no Go. A build that fails is an error, not a skip."""
    import pytest

    from kubetune_dev.binaries import NoGoError
    from support.binaries import s3_server_binary

    def to_stderr(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        return s3_server_binary(say or to_stderr)
    except NoGoError as exc:
        reason = f"the S3 server (versitygw) is not built and cannot be: {exc}"
        (say or to_stderr)(f"skipping: {reason}")
        pytest.skip(reason)


def server_argv(
    binary: Path,
    port: int,
    root: Path,
    access_key: str,
    secret_key: str,
    region: str,
    host: str = "127.0.0.1",
) -> list[str]:
    """versitygw on `host`:`port` serving ``root/data``, metadata in a sidecar dir (no
    dependence on the filesystem's xattr support), its IAM in ``root/iam``."""
    return [
        str(binary),
        f"--port={host}:{port}",
        f"--access={access_key}",
        f"--secret={secret_key}",
        f"--region={region}",
        # An IAM dir makes an unknown access key a 403 InvalidAccessKeyId, as on AWS.
        f"--iam-dir={root / 'iam'}",
        f"--access-log={root / 'access.log'}",
        "posix",
        f"--sidecar={root / 'meta'}",
        str(root / "data"),
    ]


def _answers(endpoint: str) -> bool:
    """Whether the server answers HTTP at all (an anonymous request is refused with 403)."""
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _stop(proc: subprocess.Popen[bytes], *, kill: bool) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(
    binary: Path,
    root: Path,
    access_key: str,
    secret_key: str,
    region: str,
    timeout: float,
    host: str,
) -> S3Server:
    for sub in ("data", "meta", "iam"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    log = root / "server.log"
    access_log = root / "access.log"
    # Nothing of the caller's environment (VGW_*, ROOT_ACCESS_KEY, ...) reaches the server.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root)}
    for attempt in range(3):
        port = free_port()
        with log.open("ab") as out:
            proc = subprocess.Popen(
                server_argv(binary, port, root, access_key, secret_key, region, host),
                cwd=root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not hit by a Ctrl-C meant for pytest
            )
        server = S3Server(
            endpoint=f"http://{host}:{port}",
            access_key=access_key,
            secret_key=secret_key,
            region=region,
            data_dir=root / "data",
            access_log=access_log,
            log=log,
            process=proc,
        )
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if _answers(server.endpoint):
                    # The readiness probes are not the test's requests.
                    server._log_offset = access_log.stat().st_size if access_log.exists() else 0
                    return server
                time.sleep(0.05)
        except BaseException:
            _stop(proc, kill=True)
            raise
        _stop(proc, kill=True)
        tail = server.log_tail(20)
        if "address already in use" in tail and attempt < 2:
            continue  # another process took the free port first
        why = f"exited with status {proc.returncode}" if proc.returncode else "did not answer"
        raise RuntimeError(
            f"versitygw {why} within {timeout:.0f}s on port {port}; its log ({log}):\n{tail}"
        )
    raise AssertionError("unreachable")


@contextlib.contextmanager
def s3_server(
    workdir: Path,
    *,
    binary: Path | None = None,
    access_key: str = ACCESS_KEY,
    secret_key: str = SECRET_KEY,
    region: str = REGION,
    timeout: float = START_TIMEOUT_S,
    host: str = "127.0.0.1",
) -> Iterator[S3Server]:
    """Start versitygw on a free port of `host` (an IPv4 address of this machine; loopback by
    default, or what an e2e target's pods reach, `Target.host_address`) with its data, logs and
    IAM under ``workdir/s3``, wait until it answers, and stop it on the way out: SIGTERM when
    the block ends normally, SIGKILL when it raises. `binary` defaults to the cached build,
    built here on first use (`s3_server_binary_or_skip`: the test is skipped when there is no
    Go to build it with). A server that died during the block is reported as an error."""
    if binary is None:
        binary = s3_server_binary_or_skip()
    server = _start(binary, Path(workdir) / "s3", access_key, secret_key, region, timeout, host)
    try:
        yield server
    except BaseException:
        _stop(server.process, kill=True)
        raise
    died = server.process.poll()
    _stop(server.process, kill=False)
    if died is not None:
        raise RuntimeError(
            f"versitygw exited with status {died} while in use; its log ({server.log}):\n"
            + server.log_tail(20)
        )
