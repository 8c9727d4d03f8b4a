"""A local stand-in for the Hugging Face hub, for tests that drive the real huggingface_hub client.

This is a stand-in, and the only one the project allows for the hub: tests that need the hub
point the real client (huggingface_hub, and transformers through it) at this server instead of
huggingface.co, which the test machines cannot reach. Nothing here fakes the client; what is
faked is the far end, in the hub's URL layout and with the headers and JSON that huggingface_hub
2.4.0 reads (`file_download.py`, `_snapshot_download.py`, `hf_api.py`, `utils/_http.py`).

Start it with `hub_server()`; it listens on a free loopback port (two, in fact: the hub, and a
"CDN" for large files, see below), serves from memory, and stops when the `with` block ends.
Put repositories in with `add_model` / `add_dataset`; point the client at it with `env()` (for a
subprocess) or `patch(monkeypatch)` (in-process: huggingface_hub reads `HF_ENDPOINT` once, at
import, so setting the variable in a running test is not enough; `patch` says what it changes).

What it implements:

- `GET /api/{models|datasets}/{repo}[/revision/{rev}]`: repo info (`model_info`, `dataset_info`,
  `repo_info`, `repo_exists`, `revision_exists`; `snapshot_download`'s first call): id, sha,
  private, gated, siblings (with sizes, blob ids and LFS data under `?blobs=true`), `config`
  (`architectures` and `model_type` of a model's config.json); `?expand=` keeps only the named
  properties, as the hub does.
- `GET /api/{type}s/{repo}/tree/{rev}[/{path}]` (`?recursive=`, `?expand=` adds `lastCommit`):
  files and folders (`list_repo_tree`, `list_repo_files`, and `snapshot_download`'s listing).
  All entries come in one page (the hub pages at 1000).
- `POST /api/{type}s/{repo}/paths-info/{rev}` (`get_paths_info`), `GET /api/{type}s/{repo}/refs`
  (`list_repo_refs`: branches only).
- `HEAD` and `GET` of `/{repo}/resolve/{rev}/{path}` and `/datasets/{repo}/resolve/{rev}/{path}`:
  a regular file is answered in place with `X-Repo-Commit`, `ETag` (its git blob id),
  `Content-Length` and `Accept-Ranges: bytes`. A large file (an LFS file on the hub: a suffix of
  `LFS_SUFFIXES`, or at least `LFS_MIN_SIZE` bytes) is answered `302 Found` with `X-Linked-Etag`
  (its sha256), `X-Linked-Size` and a signed `Location` on the second port, the "CDN": another
  origin, so the client stops at the redirect, takes the file's metadata from it and fetches the
  bytes there without the Authorization header. Like a presigned S3 URL, the CDN refuses a bad
  signature (403) and a request that carries an Authorization header (400).
- `Range: bytes=...` (206, 416) on every file answer, for the client's resume after a cut.
- Revisions: branches (`add_*`'s `revision`; adding to a branch again moves it to a new commit)
  and full 40-hex commit ids, the old ones included. Commit ids are sha1s of the repository's id
  and its files (paths and git blob ids): the same files give the same commit.
- Access, as the hub answers it (and so as the client classifies it):
  - no such repository: 401 without a token, 404 with a valid one; `X-Error-Code: RepoNotFound`
    either way (`RepositoryNotFoundError`);
  - a private repository (`token=...`): the same answers as for a missing one, unless the request
    carries `Authorization: Bearer <that token>`;
  - a gated repository (`token=..., gated=True`): info, tree and refs are public; a file is 401
    `GatedRepo` without a token and 403 `GatedRepo` with another valid one (`GatedRepoError`);
  - a token the server does not know at all (none of the tokens given to `add_*`) is refused on
    every route, public repositories included, with 401 and `X-Error-Message: Invalid credentials
    in Authorization header`, which the client raises as a plain `HfHubHTTPError`;
  - an unknown revision: 404 `RevisionNotFound`; an unknown file: 404 `EntryNotFound` with
    `X-Repo-Commit` (the client caches the miss).
- Faults: `fail_next(n, status)` answers the next n requests (optionally only those of a method
  or whose path contains a string) with that status and no error code, as an unwell hub or proxy
  would; `cut_next(n, after_bytes)` sends the next n file bodies' headers whole and then closes
  the connection after `after_bytes` bytes (huggingface_hub 2.4.0 keeps whole 10 MiB chunks of
  what it got and asks for the rest with a Range request; within the first chunk it starts over).
- Bookkeeping: `requests()` is every request as (method, path without the query, status), on
  both ports, in arrival order; `downloads()` counts the GETs that were answered with a file's
  bytes (200 or 206, a cut one included). HEADs, API calls, redirects and errors are not counted.

What it does not implement: Xet (no `X-Xet-*` headers or `Link: xet-auth`; the client takes its
plain HTTP path, as it does for a non-Xet repository), uploads and commits through the API, tags,
pull-request refs, `.gitattributes` (repositories hold exactly the files given), pagination,
renamed-repository redirects, spaces and kernels, rate-limit headers, the datasets-server, and
auth-check/whoami. Anything else is answered 404 without an error code.

A request the server itself fails on is answered 500 and recorded; `hub_server()` raises on exit
if that happened, so a bug here is not mistaken for a client behaviour.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import re
import secrets
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import parse_qs, quote, unquote, urlsplit

if TYPE_CHECKING:
    import pytest

LFS_SUFFIXES = frozenset(
    {
        ".7z",
        ".arrow",
        ".bin",
        ".bz2",
        ".ckpt",
        ".ftz",
        ".gguf",
        ".gz",
        ".h5",
        ".joblib",
        ".model",
        ".msgpack",
        ".npy",
        ".npz",
        ".onnx",
        ".ot",
        ".parquet",
        ".pb",
        ".pickle",
        ".pkl",
        ".pt",
        ".pth",
        ".rar",
        ".safetensors",
        ".tar",
        ".tflite",
        ".tgz",
        ".wasm",
        ".xz",
        ".zip",
        ".zst",
    }
)
"""Suffixes the hub's default .gitattributes sends to LFS: such files are served via the CDN."""
LFS_MIN_SIZE = 10 * 1024 * 1024
"""The hub keeps files from this size on in LFS, whatever their name."""

INVALID_CREDENTIALS = "Invalid credentials in Authorization header"
DATE = "2024-01-01T00:00:00.000Z"
_RANGE = re.compile(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", re.IGNORECASE)


class HubRequest(NamedTuple):
    """One request as the server saw it: method, path (percent-encoded, no query), status."""

    method: str
    path: str
    status: int


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class _Blob:
    data: bytes
    oid: str
    """The git blob id: of the content, or of the LFS pointer for an LFS file."""
    sha256: str | None
    """Set for an LFS file."""
    pointer_size: int = 0

    @property
    def size(self) -> int:
        return len(self.data)

    def lfs(self) -> dict[str, Any] | None:
        if self.sha256 is None:
            return None
        return {"oid": self.sha256, "size": self.size, "pointerSize": self.pointer_size}


def _blob(path: str, data: bytes) -> _Blob:
    if PurePosixPath(path).suffix.lower() in LFS_SUFFIXES or len(data) >= LFS_MIN_SIZE:
        sha256 = hashlib.sha256(data).hexdigest()
        pointer = (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n"
        ).encode()
        return _Blob(data, _git_oid(pointer), sha256, len(pointer))
    return _Blob(data, _git_oid(data), None)


@dataclass(frozen=True)
class _Commit:
    sha: str
    files: Mapping[str, _Blob]

    def folders(self) -> set[str]:
        out: set[str] = set()
        for path in self.files:
            parts = path.split("/")[:-1]
            out.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        return out


@dataclass
class _Repo:
    repo_type: str
    repo_id: str
    token: str | None = None
    gated: bool = False
    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)

    def resolve(self, rev: str) -> _Commit | None:
        if rev in self.refs:
            return self.commits[self.refs[rev]]
        return self.commits.get(rev.lower()) if re.fullmatch(r"[0-9a-fA-F]{40}", rev) else None

    @property
    def private(self) -> bool:
        return self.token is not None and not self.gated


@dataclass
class _Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    served: tuple[str, str] | None = None
    """(repo type, repo id) when the body is a file's bytes: a download."""


@dataclass
class _Fault:
    left: int
    status: int
    method: str | None
    path_contains: str | None


def _json(status: int, data: Any, headers: Mapping[str, str] | None = None) -> _Answer:
    body = json.dumps(data).encode()
    return _Answer(
        status, {"Content-Type": "application/json; charset=utf-8", **(headers or {})}, body
    )


def _error(
    status: int, message: str, code: str | None = None, headers: Mapping[str, str] | None = None
) -> _Answer:
    """An error the way the hub writes one: JSON body, `X-Error-Code` and `X-Error-Message`
    headers (a HEAD answer has no body, so the client reads the headers)."""
    extra = {"X-Error-Message": message, **(headers or {})}
    if code is not None:
        extra["X-Error-Code"] = code
    return _json(status, {"error": message}, extra)


def _not_found_route() -> _Answer:
    return _error(404, "Sorry, we can't find the page you are looking for.")


class HubServer:
    """The hub stand-in's state and controls; see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._log: list[HubRequest] = []
        self._served: list[tuple[str, str]] = []
        self._faults: list[_Fault] = []
        self._cuts: list[int] = []  # after_bytes of each pending cut
        self._secret = secrets.token_bytes(16)
        self._connections: set[socket.socket] = set()
        self.internal_errors: list[str] = []
        self._hub = _Server(self, "hub")
        self._cdn = _Server(self, "cdn")
        self.endpoint = f"http://127.0.0.1:{self._hub.server_address[1]}"
        """The hub's base URL, what `HF_ENDPOINT` is set to."""
        self.cdn_endpoint = f"http://127.0.0.1:{self._cdn.server_address[1]}"
        """The base URL large files are redirected to (another origin than `endpoint`)."""

    # -- repositories -------------------------------------------------------------------------

    def add_model(
        self,
        repo_id: str,
        files: Mapping[str, bytes] | Path,
        revision: str = "main",
        token: str | None = None,
        *,
        gated: bool = False,
    ) -> str:
        """Put `files` (path in the repo -> bytes, or every file under a folder) on branch
        `revision` of model repo `repo_id`, replacing what the branch held; the commit id.

        `token` makes the repository private to that token (`gated=True`: gated instead, the
        files need the token, its info and listing are public). A repository has one access
        setting: the last `add_*` for it sets it for all its revisions."""
        return self._add("model", repo_id, files, revision, token, gated)

    def add_dataset(
        self,
        repo_id: str,
        files: Mapping[str, bytes] | Path,
        revision: str = "main",
        token: str | None = None,
        *,
        gated: bool = False,
    ) -> str:
        """`add_model` for a dataset repo (`repo_type="dataset"`)."""
        return self._add("dataset", repo_id, files, revision, token, gated)

    def _add(
        self,
        repo_type: str,
        repo_id: str,
        files: Mapping[str, bytes] | Path,
        revision: str,
        token: str | None,
        gated: bool,
    ) -> str:
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo_id) or "--" in repo_id:
            raise ValueError(f"not a hub repo id: {repo_id!r} (namespace/name or name)")
        if not revision or re.fullmatch(r"[0-9a-fA-F]{40}", revision) or "/" in revision:
            raise ValueError(f"not a branch name: {revision!r}")
        if gated and token is None:
            raise ValueError("a gated repository needs the token that may read it")
        if isinstance(files, Path):
            root = files
            contents = {
                p.relative_to(root).as_posix(): p.read_bytes()
                for p in sorted(root.rglob("*"))
                if p.is_file()
            }
        else:
            contents = dict(files)
        for path, data in contents.items():
            parts = path.split("/")
            if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"not a relative file path: {path!r}")
            if not isinstance(data, bytes):
                raise TypeError(f"{path}: file content must be bytes, not {type(data).__name__}")
        blobs = {path: _blob(path, data) for path, data in sorted(contents.items())}
        digest = hashlib.sha1(f"{repo_type}\n{repo_id}\n".encode())
        for path, blob in blobs.items():
            digest.update(f"{path}\0{blob.oid}\n".encode())
        sha = digest.hexdigest()
        with self._lock:
            repo = self._repos.setdefault((repo_type, repo_id), _Repo(repo_type, repo_id))
            repo.token, repo.gated = token, gated
            repo.commits[sha] = _Commit(sha, blobs)
            repo.refs[revision] = sha
        return sha

    # -- observation and faults ---------------------------------------------------------------

    def requests(self) -> list[HubRequest]:
        """Every request so far, on both ports: (method, path without query, status)."""
        with self._lock:
            return list(self._log)

    def downloads(self, repo_id: str | None = None, repo_type: str | None = None) -> int:
        """How many GETs were answered with a file's bytes (200/206), of one repo or all."""
        with self._lock:
            return sum(
                1
                for t, r in self._served
                if (repo_id is None or r == repo_id) and (repo_type is None or t == repo_type)
            )

    def fail_next(
        self,
        n: int = 1,
        status: int = 503,
        *,
        method: str | None = None,
        path_contains: str | None = None,
    ) -> None:
        """Answer the next `n` requests (of `method`, whose path contains `path_contains`, when
        given) with `status` and a JSON error, before looking at what they ask for."""
        with self._lock:
            self._faults.append(_Fault(n, status, method and method.upper(), path_contains))

    def cut_next(self, n: int = 1, *, after_bytes: int = 65536) -> None:
        """Cut the next `n` file bodies longer than `after_bytes`: full headers, then only
        `after_bytes` bytes, then the connection is closed."""
        with self._lock:
            self._cuts.extend([after_bytes] * n)

    # -- pointing clients at it ---------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Environment for a process that should use this server as its hub.

        `HF_ENDPOINT` and no telemetry; offline modes off; progress bars off; and `HF_TOKEN` /
        `HUGGING_FACE_HUB_TOKEN` empty (the client then sends no implicit token: a developer's
        real token would otherwise go to this server, which would refuse it as unknown). A test
        that wants an implicit token sets `HF_TOKEN` after merging this. `HF_HOME` is left alone:
        give the process its own (the token file in it would be sent too)."""
        return {
            "HF_ENDPOINT": self.endpoint,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0",
            "HF_DATASETS_OFFLINE": "0",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "HF_TOKEN": "",
            "HUGGING_FACE_HUB_TOKEN": "",
        }

    def patch(self, monkeypatch: pytest.MonkeyPatch, cache_dir: Path | None = None) -> None:
        """Point this process's huggingface_hub (and transformers, datasets) at this server.

        Setting `HF_ENDPOINT` in a running process changes nothing by itself: huggingface_hub
        copies it at import into `constants.ENDPOINT` and `constants.HUGGINGFACE_CO_URL_TEMPLATE`
        (file URLs), into the hosts it trusts with the token on a redirect
        (`constants.HF_URL_HOSTS`, `utils._http._HUB_ORIGINS`), and into the endpoint of the
        module-level `HfApi` behind `huggingface_hub.model_info` & co. transformers keeps a
        shared `HfApi` made on first use, datasets its own copy of the endpoint. This sets the
        variables of `env()` and patches all of those (monkeypatch undoes it), and stops the
        client from sending a token of the developer's (`HF_TOKEN`, the token file,
        `HF_OIDC_RESOURCE`). `snapshot_download`/`hf_hub_download`/`HfApi()` made after this
        need no `endpoint=`. With `cache_dir`, the hub cache (`HF_HUB_CACHE`) goes there too."""
        import huggingface_hub.hf_api as hf_api
        from huggingface_hub import constants
        from huggingface_hub.utils import _http

        for key, value in self.env().items():
            monkeypatch.setenv(key, value)
        for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setattr(constants, "ENDPOINT", self.endpoint)
        monkeypatch.setattr(
            constants,
            "HUGGINGFACE_CO_URL_TEMPLATE",
            self.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        )
        monkeypatch.setattr(constants, "HF_URL_HOSTS", constants.HF_URL_HOSTS | {"127.0.0.1"})
        monkeypatch.setattr(
            _http, "_HUB_ORIGINS", _http._HUB_ORIGINS | {_http._url_origin(self.endpoint)}
        )
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
        no_token = Path(tempfile.gettempdir()) / f"hubserver-{id(self)}-no-token" / "token"
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(no_token))
        monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(no_token.with_name("stored")))
        monkeypatch.setattr(hf_api.api, "endpoint", self.endpoint)
        if cache_dir is not None:
            monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
            monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
        if (hub := sys.modules.get("transformers.utils.hub")) is not None:
            monkeypatch.setattr(hub, "_hf_api", None)
        if (config := sys.modules.get("datasets.config")) is not None:
            monkeypatch.setattr(config, "HF_ENDPOINT", self.endpoint)
            monkeypatch.setattr(
                config,
                "HUB_DATASETS_URL",
                self.endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}",
            )
        if (fs := sys.modules.get("huggingface_hub.hf_file_system")) is not None:
            # Its instances are cached and keep the endpoint they were made with.
            fs.HfFileSystem.clear_instance_cache()

    # -- serving ------------------------------------------------------------------------------

    def _start(self) -> None:
        for server in (self._hub, self._cdn):
            threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
            ).start()

    def _stop(self) -> None:
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()
        with self._lock:
            open_connections = list(self._connections)
        for conn in open_connections:  # idle keep-alive connections of the client's pool
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _track(self, conn: socket.socket, alive: bool) -> None:
        with self._lock:
            if alive:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    def _record(self, method: str, path: str, answer: _Answer) -> None:
        with self._lock:
            self._log.append(HubRequest(method, path, answer.status))
            if answer.served is not None and method == "GET" and answer.status in (200, 206):
                self._served.append(answer.served)

    def _fault(self, method: str, path: str) -> _Answer | None:
        with self._lock:
            for fault in self._faults:
                if fault.left <= 0:
                    continue
                if fault.method is not None and fault.method != method:
                    continue
                if fault.path_contains is not None and fault.path_contains not in path:
                    continue
                fault.left -= 1
                return _error(fault.status, f"injected fault: HTTP {fault.status}")
        return None

    def _take_cut(self, size: int) -> int | None:
        with self._lock:
            for i, after in enumerate(self._cuts):
                if size > after:
                    del self._cuts[i]
                    return after
        return None

    def _answer(
        self, role: str, method: str, raw_path: str, query: str, headers: Any, body: bytes
    ) -> _Answer:
        segments = [unquote(s) for s in raw_path.split("/")[1:]]
        params = parse_qs(query)
        if role == "cdn":
            return self._cdn_answer(method, segments, params, headers)
        auth = headers.get("Authorization")
        token: str | None = None
        if auth:
            scheme, _, value = auth.partition(" ")
            token = value.strip() if scheme.lower() == "bearer" else None
            with self._lock:
                known = {r.token for r in self._repos.values() if r.token is not None}
            if token not in known:
                return _error(401, INVALID_CREDENTIALS)
        if segments[:1] == ["api"] and len(segments) >= 3 and segments[1] in ("models", "datasets"):
            return self._api(method, segments[1][:-1], segments[2:], params, token, headers, body)
        repo_type = "model"
        if segments[:1] == ["datasets"]:
            repo_type, segments = "dataset", segments[1:]
        for n in (2, 1):
            if len(segments) > n + 1 and segments[n] == "resolve" and method in ("GET", "HEAD"):
                return self._resolve(
                    method,
                    repo_type,
                    "/".join(segments[:n]),
                    segments[n + 1],
                    "/".join(segments[n + 2 :]),
                    token,
                    headers,
                )
        return _not_found_route()

    def _lookup(self, repo_type: str, segments: list[str]) -> tuple[_Repo | None, list[str]]:
        """The repo an API path starts with (namespace/name, or name), and the rest."""
        with self._lock:
            for n in (2, 1):
                repo = self._repos.get((repo_type, "/".join(segments[:n])))
                if repo is not None and len(segments) >= n:
                    return repo, segments[n:]
        return None, []

    def _commit(self, repo: _Repo, rev: str) -> _Commit | None:
        with self._lock:
            return repo.resolve(rev)

    @staticmethod
    def _repo_not_found(token: str | None) -> _Answer:
        # The hub does not tell a missing repository from one the caller may not see: 401 to an
        # anonymous caller, 404 to an authenticated one.
        if token is None:
            return _error(401, "Invalid username or password.", "RepoNotFound")
        return _error(404, "Repository not found", "RepoNotFound")

    def _visible(self, repo: _Repo, token: str | None) -> bool:
        return not repo.private or token == repo.token

    def _api(
        self,
        method: str,
        repo_type: str,
        segments: list[str],
        params: dict[str, list[str]],
        token: str | None,
        headers: Any,
        body: bytes,
    ) -> _Answer:
        repo, rest = self._lookup(repo_type, segments)
        if repo is None or not self._visible(repo, token):
            return self._repo_not_found(token)
        with self._lock:
            refs = dict(repo.refs)
        if method == "GET" and rest == ["refs"]:
            branches = [
                {"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha}
                for name, sha in sorted(refs.items())
            ]
            return _json(200, {"branches": branches, "converts": [], "tags": []})
        if (method == "GET" and not rest) or (
            method == "GET" and len(rest) == 2 and rest[0] == "revision"
        ):
            rev = rest[1] if rest else "main"
            commit = self._commit(repo, rev)
            if commit is None:
                return _error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            return _json(200, self._info(repo, commit, params))
        if len(rest) >= 2 and rest[0] in ("tree", "paths-info"):
            commit = self._commit(repo, rest[1])
            if commit is None:
                return _error(404, f"Invalid rev id: {rest[1]}", "RevisionNotFound")
            expand = params.get("expand", ["false"])[-1].lower() == "true"
            if rest[0] == "tree" and method == "GET":
                return self._tree(commit, "/".join(rest[2:]).strip("/"), params, expand)
            if rest[0] == "paths-info" and method == "POST" and len(rest) == 2:
                return self._paths_info(commit, headers, body)
        return _not_found_route()

    def _info(self, repo: _Repo, commit: _Commit, params: dict[str, list[str]]) -> dict[str, Any]:
        blobs = params.get("blobs", ["false"])[-1].lower() == "true"
        siblings: list[dict[str, Any]] = []
        for path, blob in commit.files.items():
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                sibling.update(size=blob.size, blobId=blob.oid)
                if blob.sha256 is not None:
                    sibling["lfs"] = {
                        "sha256": blob.sha256,
                        "size": blob.size,
                        "pointerSize": blob.pointer_size,
                    }
            siblings.append(sibling)
        info: dict[str, Any] = {
            "_id": hashlib.sha1(f"{repo.repo_type}/{repo.repo_id}".encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "author": repo.repo_id.split("/")[0] if "/" in repo.repo_id else None,
            "sha": commit.sha,
            "lastModified": DATE,
            "createdAt": DATE,
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(b.size for b in commit.files.values()),
        }
        if repo.repo_type == "model":
            info["modelId"] = repo.repo_id
            config = commit.files.get("config.json")
            if config is not None:
                with contextlib.suppress(ValueError):
                    parsed = json.loads(config.data)
                    if isinstance(parsed, dict):
                        info["config"] = {
                            k: parsed[k] for k in ("architectures", "model_type") if k in parsed
                        }
        expand = [v for key in ("expand", "expand[]") for v in params.get(key, [])]
        if expand:
            info = {k: v for k, v in info.items() if k in ("_id", "id", *expand)}
        return info

    @staticmethod
    def _entry(commit: _Commit, path: str, expand: bool) -> dict[str, Any] | None:
        last = {"id": commit.sha, "title": "Upload", "date": DATE}
        blob = commit.files.get(path)
        if blob is not None:
            entry: dict[str, Any] = {
                "type": "file",
                "oid": blob.oid,
                "size": blob.size,
                "path": path,
            }
            if (lfs := blob.lfs()) is not None:
                entry["lfs"] = lfs
        elif path in commit.folders():
            inside = sorted(
                f"{p}\0{b.oid}" for p, b in commit.files.items() if p.startswith(path + "/")
            )
            oid = hashlib.sha1("\n".join(inside).encode()).hexdigest()
            entry = {"type": "directory", "oid": oid, "size": 0, "path": path}
        else:
            return None
        if expand:
            entry["lastCommit"] = last
        return entry

    def _tree(
        self, commit: _Commit, path: str, params: dict[str, list[str]], expand: bool
    ) -> _Answer:
        recursive = params.get("recursive", ["false"])[-1].lower() == "true"
        if path and path not in commit.folders():
            return _error(404, f"Entry not found: {path}", "EntryNotFound")
        prefix = f"{path}/" if path else ""
        names = sorted({*commit.files, *commit.folders()})
        inside = [n for n in names if n.startswith(prefix)]
        if not recursive:
            inside = [n for n in inside if "/" not in n[len(prefix) :]]
        entries = [self._entry(commit, n, expand) for n in inside]
        return _json(200, [e for e in entries if e is not None])

    def _paths_info(self, commit: _Commit, headers: Any, body: bytes) -> _Answer:
        if "json" in (headers.get("Content-Type") or ""):
            data = json.loads(body or b"{}")
            paths, expand = list(data.get("paths", [])), bool(data.get("expand"))
        else:
            form = parse_qs(body.decode(), keep_blank_values=True)
            paths = form.get("paths", [])
            expand = form.get("expand", ["false"])[-1].lower() == "true"
        entries = [self._entry(commit, p.strip("/"), expand) for p in paths]
        return _json(200, [e for e in entries if e is not None])

    def _resolve(
        self,
        method: str,
        repo_type: str,
        repo_id: str,
        rev: str,
        path: str,
        token: str | None,
        headers: Any,
    ) -> _Answer:
        with self._lock:
            repo = self._repos.get((repo_type, repo_id))
        if repo is None or not self._visible(repo, token):
            return self._repo_not_found(token)
        if repo.gated and token != repo.token:
            kind = "model" if repo_type == "model" else repo_type
            if token is None:
                message = (
                    f"Access to {kind} {repo_id} is restricted. You must have access to it and "
                    "be authenticated to access it. Please log in."
                )
                return _error(401, message, "GatedRepo")
            message = (
                f"Access to {kind} {repo_id} is restricted and you are not in the authorized "
                f"list. Visit {self.endpoint}/{repo_id} to ask for access."
            )
            return _error(403, message, "GatedRepo")
        commit = self._commit(repo, rev)
        if commit is None:
            return _error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        blob = commit.files.get(path)
        if blob is None:
            return _error(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.sha})
        if blob.sha256 is not None:
            location = self._cdn_url(repo_type, repo_id, blob.sha256)
            return _Answer(
                302,
                {
                    "Location": location,
                    "X-Repo-Commit": commit.sha,
                    "X-Linked-Etag": f'"{blob.sha256}"',
                    "X-Linked-Size": str(blob.size),
                    "Content-Type": "text/plain; charset=utf-8",
                },
                f"Found. Redirecting to {location}".encode(),
            )
        name = path.rsplit("/", 1)[-1]
        return self._bytes(
            blob.data,
            headers,
            {
                "X-Repo-Commit": commit.sha,
                "ETag": f'"{blob.oid}"',
                "Content-Disposition": f"inline; filename*=UTF-8''{quote(name)}",
            },
            (repo_type, repo_id),
        )

    def _sign(self, repo_type: str, repo_id: str, sha256: str) -> str:
        msg = f"{repo_type}|{repo_id}|{sha256}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()[:32]

    def _cdn_url(self, repo_type: str, repo_id: str, sha256: str) -> str:
        sig = self._sign(repo_type, repo_id, sha256)
        return f"{self.cdn_endpoint}/lfs/{repo_type}s/{repo_id}/{sha256}?X-Signature={sig}"

    def _cdn_answer(
        self, method: str, segments: list[str], params: dict[str, list[str]], headers: Any
    ) -> _Answer:
        if method not in ("GET", "HEAD") or len(segments) < 4 or segments[0] != "lfs":
            return _error(404, "NoSuchKey")
        repo_type, repo_id, sha256 = (
            segments[1].removesuffix("s"),
            "/".join(segments[2:-1]),
            segments[-1],
        )
        if headers.get("Authorization"):
            return _error(400, "InvalidArgument: Only one auth mechanism allowed")
        sig = params.get("X-Signature", [""])[-1]
        if not hmac.compare_digest(sig, self._sign(repo_type, repo_id, sha256)):
            return _error(403, "AccessDenied: signature does not match")
        with self._lock:
            repo = self._repos.get((repo_type, repo_id))
            commits = list(repo.commits.values()) if repo is not None else []
        for commit in commits:
            for blob in commit.files.values():
                if blob.sha256 == sha256:
                    return self._bytes(
                        blob.data, headers, {"ETag": f'"{sha256}"'}, (repo_type, repo_id)
                    )
        return _error(404, "NoSuchKey")

    @staticmethod
    def _bytes(
        data: bytes, headers: Any, extra: Mapping[str, str], served: tuple[str, str]
    ) -> _Answer:
        size = len(data)
        out = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", **extra}
        match = _RANGE.fullmatch(headers.get("Range") or "")
        if match is None or not (match[1] or match[2]):
            return _Answer(200, out, data, served)
        if match[1]:
            start = int(match[1])
            end = min(int(match[2]) + 1, size) if match[2] else size
        else:
            start, end = max(size - int(match[2]), 0), size
        if start >= size or start >= end:
            return _error(
                416, "Requested Range Not Satisfiable", None, {"Content-Range": f"bytes */{size}"}
            )
        out["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        return _Answer(206, out, data[start:end], served)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # keep-alive connections idle in the client's pool must not block close

    def __init__(self, hub: HubServer, role: str) -> None:
        self.hub = hub
        self.role = role
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hubserver"
    sys_version = ""
    timeout = 60
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.hub._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.hub._track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def _handle(self) -> None:
        hub = self.server.hub
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length > 0 else b""
        split = urlsplit(self.path)
        method = self.command
        answer = hub._fault(method, split.path)
        if answer is None:
            try:
                answer = hub._answer(
                    self.server.role, method, split.path, split.query, self.headers, body
                )
            except Exception:
                hub.internal_errors.append(f"{method} {self.path}:\n{traceback.format_exc()}")
                answer = _error(500, "hubserver internal error (see HubServer.internal_errors)")
        hub._record(method, split.path, answer)
        cut = None
        if method == "GET" and answer.served is not None:
            cut = hub._take_cut(len(answer.body))
        self.send_response(answer.status)
        for key, value in answer.headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(answer.body)))
        self.send_header("X-Request-Id", f"hubserver-{len(hub._log)}")
        self.end_headers()
        if method == "HEAD":
            return
        if cut is None:
            self.wfile.write(answer.body)
            return
        self.wfile.write(answer.body[:cut])
        self.wfile.flush()
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def hub_server() -> Iterator[HubServer]:
    """A running `HubServer` on loopback; stopped (and checked for its own errors) on exit."""
    server = HubServer()
    server._start()
    try:
        yield server
    finally:
        server._stop()
    if server.internal_errors:
        raise AssertionError(
            "the hub stand-in failed on requests:\n" + "\n".join(server.internal_errors)
        )
