"""What every source's fetcher shares: the progress it reports, what it found, the retries
around a flaky source, and pruning what a killed try left behind."""

from __future__ import annotations

import errno
import json
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from kubetune_trainer import hub
from kubetune_trainer.errors import ConfigError, TrainerExit

T = TypeVar("T")

MiB = 1024**2


class SourceUnavailable(TrainerExit):
    """S3 or an https server could not be reached, or kept failing, after a few tries: a
    restart may find it well again (exit 1)."""


@dataclass
class Progress:
    """Counts finished files and bytes of one source; prints a JSON line per file. `in_flight`
    holds the bytes of files still arriving, by file."""

    what: str
    uri: str
    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0
    downloaded_bytes: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def expect(self, files: int, nbytes: int) -> None:
        with self._lock:
            self.files_total += files
            self.bytes_total += nbytes

    def moving(self, name: str, nbytes: int) -> None:
        """`nbytes` of file `name` have arrived so far (0: none, or none any more)."""
        with self._lock:
            if nbytes > 0:
                self.in_flight[name] = nbytes
            else:
                self.in_flight.pop(name, None)

    def counts(self) -> tuple[int, int, int, int]:
        """(files_done, files_total, bytes_done with the bytes still arriving, bytes_total)."""
        with self._lock:
            arriving = self.bytes_done + sum(self.in_flight.values())
            return self.files_done, self.files_total, arriving, self.bytes_total

    def done(self, name: str, nbytes: int, *, downloaded: bool = True) -> None:
        with self._lock:
            self.in_flight.pop(name, None)
            self.files_done += 1
            self.bytes_done += nbytes
            if downloaded:
                self.downloaded_bytes += nbytes
            line = {
                "event": "stagein_file",
                "what": self.what,
                "uri": self.uri,
                "file": name,
                "file_bytes": nbytes,
                "reused": not downloaded,
                "files_done": self.files_done,
                "files_total": self.files_total,
                "bytes_done": self.bytes_done,
                "bytes_total": self.bytes_total,
            }
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()


@dataclass(frozen=True)
class Fetched:
    """What a fetcher found: the revision it resolved, and what a job reads ("." = all)."""

    commit: str | None = None
    target: str = "."
    versions: dict[str, str] | None = None
    """What identifies each fetched file at the source, by file name (S3: its ETag), so a
    cache hit can be checked against the source as it is now; None where the revision does."""


def causes(e: BaseException) -> list[BaseException]:
    """`e` and the errors it was raised from (clients wrap one another's errors)."""
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in seen and len(seen) < 16:
        seen.append(cur)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return seen


def retrying(
    fn: Callable[[], T],
    classify: Callable[[BaseException], ConfigError | str | None],
    *,
    what: str,
    uri: str,
) -> T:
    """`hub.retrying` for S3 and https: the last transient failure restarts the pod."""

    def gave_up(tries: int, detail: str) -> TrainerExit:
        return SourceUnavailable(
            f"{what} {uri}: failed {tries} times ({detail}); the pod is restarted and tries again"
        )

    return hub.retrying(fn, classify, what=what, uri=uri, gave_up=gave_up)


def _no_room(e: BaseException, what: str, uri: str) -> ConfigError | None:
    for err in causes(e):
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return ConfigError(
                f"{what} {uri}: the cache volume is full ({err.strerror}). To fix: give the "
                "stage-in cache volume more room, or remove entries nobody uses"
            )
    return None


def prune(dest: Path, keep: set[str]) -> None:
    """Remove every file under `dest` that is not one of `keep` (relative paths)."""
    for path in sorted(dest.rglob("*"), reverse=True):
        rel = path.relative_to(dest).as_posix()
        if path.is_file() and rel not in keep:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
