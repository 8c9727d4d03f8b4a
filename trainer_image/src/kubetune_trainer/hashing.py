"""The sha256 of a file, read in chunks: what checkpoint manifests and cache entries record."""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 8 * 2**20


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()
