"""The tests' S3 server (support/s3server.py): a real versitygw, built from Go modules.

Each test gets a server of its own (it starts in well under a second), so the access log holds
only that test's requests. Needs no control plane: only the versitygw build, which is made on
first use and cached (skipped, with the reason, when there is no Go to build it with).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from support.s3server import S3Server, parse_access_line, s3_server, s3_server_binary_or_skip

pytestmark = pytest.mark.tooling

MiB = 2**20


@pytest.fixture(scope="module")
def s3_binary(pytestconfig: pytest.Config) -> Path:
    """versitygw, built on first use; what the build says goes to the terminal."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")

    def say(msg: str) -> None:
        shown = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
        with shown:
            print(f"\n{msg}", file=sys.stderr, flush=True)

    return s3_server_binary_or_skip(say)


@pytest.fixture
def s3(tmp_path: Path, s3_binary: Path) -> Iterator[S3Server]:
    with s3_server(tmp_path, binary=s3_binary) as server:
        yield server


def error_of(exc: pytest.ExceptionInfo[ClientError]) -> tuple[int, str]:
    response: Any = exc.value.response
    return response["ResponseMetadata"]["HTTPStatusCode"], response["Error"]["Code"]


def test_put_and_get_an_object(s3: S3Server) -> None:
    s3.make_bucket("data")
    client = s3.client()
    body = b"hello, object store\n" * 100
    put = client.put_object(Bucket="data", Key="dir/hello.txt", Body=body)
    assert put["ETag"] == f'"{hashlib.md5(body).hexdigest()}"'

    got = client.get_object(Bucket="data", Key="dir/hello.txt")
    assert got["Body"].read() == body
    assert got["ContentLength"] == len(body)
    assert client.head_object(Bucket="data", Key="dir/hello.txt")["ContentLength"] == len(body)
    # a ranged GET is served too
    part = client.get_object(Bucket="data", Key="dir/hello.txt", Range="bytes=7-18")
    assert part["Body"].read() == body[7:19]
    # and the object is a plain file of the posix backend
    assert (s3.data_dir / "data" / "dir" / "hello.txt").read_bytes() == body


def test_multipart_upload_round_trips_byte_exact(s3: S3Server, tmp_path: Path) -> None:
    s3.make_bucket("big")
    client = s3.client()
    data = os.urandom(17 * MiB + 12_345)  # three parts of 8 MiB, the last one short
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    config = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB)

    client.upload_file(str(src), "big", "weights/blob.bin", Config=config)

    ops = [r.operation for r in s3.requests() if r.key == "weights/blob.bin"]
    assert ops.count("CreateMultipartUpload") == 1
    assert ops.count("UploadPart") == 3
    assert ops.count("CompleteMultipartUpload") == 1
    assert "PutObject" not in ops
    head = client.head_object(Bucket="big", Key="weights/blob.bin")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-3")  # a multipart object's ETag counts its parts

    body = client.get_object(Bucket="big", Key="weights/blob.bin")["Body"].read()
    assert hashlib.sha256(body).hexdigest() == hashlib.sha256(data).hexdigest()
    assert body == data
    out = tmp_path / "blob.out"
    client.download_file("big", "weights/blob.bin", str(out), Config=config)
    assert out.read_bytes() == data


def test_list_with_prefix(s3: S3Server, tmp_path: Path) -> None:
    tree = tmp_path / "model"
    for rel in ("config.json", "tokenizer.json", "shards/model-00001.safetensors", "shards/x.bin"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(rel)
    (tmp_path / "other.txt").write_text("not part of the model")
    s3.make_bucket("models")

    keys = s3.put_tree("models", "tiny/v1/", tree)
    s3.client().upload_file(str(tmp_path / "other.txt"), "models", "tiny/v10/other.txt")

    assert keys == [
        "tiny/v1/config.json",
        "tiny/v1/shards/model-00001.safetensors",
        "tiny/v1/shards/x.bin",
        "tiny/v1/tokenizer.json",
    ]
    client = s3.client()
    listed = client.list_objects_v2(Bucket="models", Prefix="tiny/v1/")
    assert [o["Key"] for o in listed["Contents"]] == keys
    assert listed["KeyCount"] == 4
    sizes = {o["Key"]: o["Size"] for o in listed["Contents"]}
    assert sizes == {k: len(k.removeprefix("tiny/v1/")) for k in keys}
    # a prefix without the slash also matches the sibling "directory"
    assert len(client.list_objects_v2(Bucket="models", Prefix="tiny/v1")["Contents"]) == 5
    # one level at a time with a delimiter
    level = client.list_objects_v2(Bucket="models", Prefix="tiny/v1/", Delimiter="/")
    assert [o["Key"] for o in level["Contents"]] == [keys[0], keys[3]]
    assert [p["Prefix"] for p in level["CommonPrefixes"]] == ["tiny/v1/shards/"]
    # paging
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket="models", Prefix="tiny/v1/", PaginationConfig={"PageSize": 3}
    )
    paged = [[o["Key"] for o in page.get("Contents", [])] for page in pages]
    assert paged == [keys[:3], keys[3:]]
    assert client.list_objects_v2(Bucket="models", Prefix="nothing/")["KeyCount"] == 0


def test_wrong_credentials_are_refused(s3: S3Server) -> None:
    s3.make_bucket("private")
    s3.client().put_object(Bucket="private", Key="secret.txt", Body=b"s3cr3t")

    unknown_key = s3.client(access_key="NOSUCHACCESSKEY")
    with pytest.raises(ClientError) as exc:
        unknown_key.get_object(Bucket="private", Key="secret.txt")
    assert error_of(exc) == (403, "InvalidAccessKeyId")
    with pytest.raises(ClientError) as exc:
        unknown_key.list_objects_v2(Bucket="private")
    assert error_of(exc) == (403, "InvalidAccessKeyId")

    wrong_secret = s3.client(secret_key="not-the-secret")
    with pytest.raises(ClientError) as exc:
        wrong_secret.get_object(Bucket="private", Key="secret.txt")
    assert error_of(exc) == (403, "SignatureDoesNotMatch")
    with pytest.raises(ClientError) as exc:
        wrong_secret.put_object(Bucket="private", Key="new.txt", Body=b"x")
    assert error_of(exc) == (403, "SignatureDoesNotMatch")

    # anonymous requests are refused too
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(f"{s3.endpoint}/private/secret.txt", timeout=10)
    assert http.value.code == 403

    # refused GETs are logged as such and are not downloads
    refused = [r for r in s3.requests() if r.operation == "GetObject"]
    assert [(r.status, r.error) for r in refused] == [
        (403, "InvalidAccessKeyId"),
        (403, "SignatureDoesNotMatch"),
        (403, "AccessDenied"),
    ]
    assert s3.gets() == 0
    assert not (s3.data_dir / "private" / "new.txt").exists()


def test_missing_key_is_404_no_such_key(s3: S3Server) -> None:
    s3.make_bucket("data")
    client = s3.client()
    with pytest.raises(ClientError) as exc:
        client.get_object(Bucket="data", Key="missing/model.safetensors")
    assert error_of(exc) == (404, "NoSuchKey")
    with pytest.raises(ClientError) as exc:  # HEAD has no body: botocore names it by status
        client.head_object(Bucket="data", Key="missing/model.safetensors")
    assert error_of(exc) == (404, "404")
    with pytest.raises(ClientError) as exc:
        client.get_object(Bucket="no-such-bucket", Key="x")
    assert error_of(exc) == (404, "NoSuchBucket")
    assert s3.gets() == 0


def test_access_log_counts_exactly_the_gets(s3: S3Server, tmp_path: Path) -> None:
    s3.make_bucket("models")
    s3.make_bucket("datasets")
    client = s3.client()
    for key in ("tiny/a.bin", "tiny/b.bin", "small/c.bin"):
        client.put_object(Bucket="models", Key=key, Body=key.encode() * 1000)
    client.put_object(Bucket="datasets", Key="alpaca/train.jsonl", Body=b"{}\n")
    assert s3.gets() == 0  # uploads, bucket creation: no GETs

    client.get_object(Bucket="models", Key="tiny/a.bin")["Body"].read()
    client.get_object(Bucket="models", Key="tiny/a.bin")["Body"].read()
    client.get_object(Bucket="models", Key="tiny/b.bin", Range="bytes=0-9")["Body"].read()
    client.download_file("models", "small/c.bin", str(tmp_path / "c.bin"))
    client.get_object(Bucket="datasets", Key="alpaca/train.jsonl")["Body"].read()
    # not GETs of an object: HEAD, LIST, a failed GET
    client.head_object(Bucket="models", Key="tiny/a.bin")
    client.list_objects_v2(Bucket="models", Prefix="tiny/")
    with pytest.raises(ClientError):
        client.get_object(Bucket="models", Key="tiny/missing.bin")

    assert s3.gets() == 5
    assert s3.gets("models") == 4
    assert s3.gets("models", "tiny/") == 3
    assert s3.gets("models", "tiny/a.bin") == 2
    assert s3.gets("models", "small/") == 1
    assert s3.gets("datasets") == 1
    assert s3.gets(prefix="alpaca/") == 1
    assert s3.gets("nothing-here") == 0

    gets = [r for r in s3.requests() if r.operation == "GetObject"]
    assert [(r.bucket, r.key, r.error) for r in gets] == [
        ("models", "tiny/a.bin", None),
        ("models", "tiny/a.bin", None),
        ("models", "tiny/b.bin", None),
        ("models", "small/c.bin", None),
        ("datasets", "alpaca/train.jsonl", None),
        ("models", "tiny/missing.bin", "NoSuchKey"),
    ]
    assert {r.requester for r in gets} == {s3.access_key}
    ops = [r.operation for r in s3.requests()]
    assert ops.count("HeadObject") == 2  # ours, and download_file's
    assert ops.count("ListObjectsV2") == 1

    # a second "job" that finds everything in place downloads nothing more
    before = s3.gets("models", "tiny/")
    client.head_object(Bucket="models", Key="tiny/a.bin")
    assert s3.gets("models", "tiny/") == before


def test_env_is_all_boto3_needs(s3: S3Server, tmp_path: Path) -> None:
    """A separate process (as the trainer's stage-in will be) finds the server through the
    environment alone, and is refused with a wrong key in it."""
    s3.make_bucket("data")
    s3.client().put_object(Bucket="data", Key="k/obj.txt", Body=b"from the environment")
    script = (
        "import sys, boto3\n"
        "from botocore.exceptions import ClientError\n"
        "try:\n"
        "    body = boto3.client('s3').get_object(Bucket='data', Key='k/obj.txt')['Body'].read()\n"
        "except ClientError as e:\n"
        "    print(e.response['Error']['Code']); sys.exit(3)\n"
        "sys.stdout.write(body.decode())\n"
    )
    base = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),  # no ~/.aws of the host
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }

    ok = subprocess.run(
        [sys.executable, "-c", script],
        env={**base, **s3.env()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (ok.returncode, ok.stdout) == (0, "from the environment"), ok.stderr
    assert s3.env().keys() >= {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
        "AWS_ENDPOINT_URL",
    }

    refused = subprocess.run(
        [sys.executable, "-c", script],
        env={**base, **s3.env(secret_key="wrong")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (refused.returncode, refused.stdout.strip()) == (3, "SignatureDoesNotMatch")
    assert s3.gets("data") == 1


def test_server_lifecycle(tmp_path: Path, s3_binary: Path) -> None:
    """Stopped when the block ends (killed when it raises), and nothing is left listening."""
    with s3_server(tmp_path / "one", binary=s3_binary) as s3:
        proc, endpoint = s3.process, s3.endpoint
        assert s3.requests() == []  # the readiness probes are not counted
        assert proc.poll() is None
    assert proc.returncode is not None
    with pytest.raises(OSError):
        urllib.request.urlopen(endpoint, timeout=5)

    with pytest.raises(KeyError), s3_server(tmp_path / "two", binary=s3_binary) as s3:
        proc = s3.process
        raise KeyError("the test failed")
    assert proc.returncode == -9  # SIGKILL

    # two servers side by side do not share ports, data or logs
    with (
        s3_server(tmp_path / "a", binary=s3_binary) as a,
        s3_server(tmp_path / "b", binary=s3_binary) as b,
    ):
        assert a.endpoint != b.endpoint
        a.make_bucket("only-in-a")
        assert [x["Name"] for x in a.client().list_buckets()["Buckets"]] == ["only-in-a"]
        assert b.client().list_buckets().get("Buckets", []) == []


def test_parse_access_line() -> None:
    line = (
        "KEY models [24/November/2026:18:21:20 +0000] 127.0.0.1 KEY MASRHP6CONY61NAA "
        "s3_GetObject dir/with space+plus%.txt /models/dir/with%20space%2Bplus%25.txt 200 - 0 5 "
        "1 1 - Boto3/1.44.8 md/Botocore#1.44.8 ua/2.1 - hostid SigV4 - AuthHeader "
        "s3.us-east-1.amazonaws.com - arn:aws:s3:::/models/dir Yes"
    )
    parsed = parse_access_line(line)
    assert parsed is not None
    assert (parsed.operation, parsed.bucket, parsed.key) == (
        "GetObject",
        "models",
        "dir/with space+plus%.txt",
    )
    assert (parsed.status, parsed.error, parsed.requester, parsed.ok) == (200, None, "KEY", True)
    refused = parse_access_line(
        "- models [24/November/2026:18:21:20 +0000] 127.0.0.1 - 4RAQ s3_ListObjectsV2 - "
        "/models?list-type=2 403 InvalidAccessKeyId 0 0 0 0 - curl/8 - x SigV4"
    )
    assert refused is not None
    assert (refused.key, refused.requester, refused.status, refused.ok) == (None, None, 403, False)
    assert parse_access_line("log starts 2026-11-24 18:20:59.835630306 +0000 UTC") is None
