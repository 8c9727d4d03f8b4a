"""https: urllib streams the URL to a file (its name the URL's last path segment, which must
be a data file's, so that its format is known)."""

from __future__ import annotations

import http.client
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath

from kubetune_trainer.contract import DATA_SUFFIXES as SUFFIXES
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.stagein.fetch.base import (
    Fetched,
    MiB,
    Progress,
    _no_room,
    causes,
    prune,
    retrying,
)
from kubetune_trainer.uris import Form, UriError, parse_uri

HTTP_TIMEOUT_S = 60.0


def classify_https(
    e: BaseException, *, what: str, uri: str, field: str
) -> ConfigError | str | None:
    room = _no_room(e, what, uri)
    if room is not None:
        return room
    for err in causes(e):
        if isinstance(err, urllib.error.HTTPError):
            if err.code in (408, 425, 429) or err.code >= 500:
                return f"HTTP {err.code} {err.reason}"
            fix = {
                401: "the URL needs credentials: put the data where the job can read it "
                "(a signed URL, S3, the hub or a volume)",
                403: "the server refuses to serve it: use a URL the job may read",
                404: f"check {field}",
                410: f"check {field}",
            }.get(err.code, f"check {field}")
            return ConfigError(
                f"{what} {uri}: the server answered HTTP {err.code} {err.reason}. To fix: {fix}"
            )
        if isinstance(err, urllib.error.URLError | http.client.HTTPException):
            return f"{type(err).__name__}: {err}"
        if isinstance(err, ConnectionError | TimeoutError | socket.timeout):
            return f"{type(err).__name__}: {err}"
    return None


def fetch_https(uri: str, *, what: str, field: str, dest: Path, progress: Progress) -> Fetched:
    """Stream the file at `uri` into `dest/<its name>`."""
    try:
        parsed = parse_uri(uri, (Form.HTTPS, Form.HTTP), field=field)
    except UriError as e:
        raise ConfigError(str(e)) from None
    name = urllib.parse.unquote(PurePosixPath(parsed.path).name)
    if PurePosixPath(name).suffix not in SUFFIXES or name.startswith("."):
        raise ConfigError(
            f"{what} {uri}: the URL's path does not end in a data file name ({', '.join(SUFFIXES)})"
            f", so its format is unknown. To fix: point {field} at a URL ending in one"
        )
    path = dest / name
    part = dest / f".{name}.part"

    def get() -> int:
        request = urllib.request.Request(uri, headers={"User-Agent": "kubetune-stagein"})
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            length = response.headers.get("Content-Length")
            if length is not None and progress.bytes_total == 0:
                progress.expect(0, int(length))
            got = 0
            progress.moving(name, 0)
            with part.open("wb") as fh:
                while chunk := response.read(MiB):
                    fh.write(chunk)
                    got += len(chunk)
                    progress.moving(name, got)
        got = part.stat().st_size
        if length is not None and got != int(length):
            raise ConnectionError(f"{got} of {length} bytes arrived")
        os.replace(part, path)
        return got

    progress.expect(1, 0)
    size = retrying(
        get,
        lambda e: classify_https(e, what=what, uri=uri, field=field),
        what=what,
        uri=uri,
    )
    progress.done(name, size)
    prune(dest, {name})
    return Fetched(target=name)
