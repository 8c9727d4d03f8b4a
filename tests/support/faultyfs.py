"""A FUSE file system that passes every call through to a folder, and fails reads with a
real EIO where told: the kernel returns the error to the reader, below Python, as a disk or
an NFS server in trouble does.

    python -m support.faultyfs SOURCE MOUNTPOINT CONTROL   # in the foreground

While the file CONTROL exists, a read(2) of any file whose name is one of CONTROL's lines
fails with EIO; remove CONTROL (or empty it) and reads succeed again. `mounted()` starts it
for a test and unmounts it afterwards. Needs /dev/fuse, the libfuse2 library, the `fusepy`
package and the right to mount (root, or fusermount); `unavailable()` says what is missing.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import errno
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def unavailable() -> str | None:
    """Why a FUSE file system cannot be mounted here; None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if ctypes.util.find_library("fuse") is None:
        return "the libfuse2 library is not installed (Debian package libfuse2)"
    try:
        import fuse  # noqa: F401  (fusepy)
    except (ImportError, OSError) as e:
        return f"fusepy cannot be imported: {e}"
    if os.geteuid() != 0 and shutil.which("fusermount") is None:
        return "not root and no fusermount to mount with"
    return None


@contextlib.contextmanager
def mounted(source: Path, mountpoint: Path, control: Path) -> Iterator[None]:
    """`source` at `mountpoint` through the faulty file system, for the `with` block."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    support = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{support}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "support.faultyfs", str(source), str(mountpoint), str(control)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.communicate(timeout=5)[0] if proc.poll() is not None else ""
                raise RuntimeError(f"faultyfs did not mount {mountpoint}: {out.strip()}")
            time.sleep(0.05)
        yield
    finally:
        umount = ["umount"] if os.geteuid() == 0 else ["fusermount", "-u"]
        subprocess.run([*umount, str(mountpoint)], capture_output=True, check=False)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve(source: str, mountpoint: str, control: str) -> None:
    from fuse import FUSE, FuseOSError, Operations

    class Faulty(Operations):
        """Passes through to `source`; reads of the named files fail with EIO."""

        def __init__(self) -> None:
            self.root = os.path.realpath(source)

        def _full(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def _failing(self, path: str) -> bool:
            try:
                names = Path(control).read_text().split()
            except FileNotFoundError:
                return False
            return os.path.basename(path) in names

        def access(self, path: str, mode: int) -> None:
            if not os.access(self._full(path), mode):
                raise FuseOSError(errno.EACCES)

        def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
            st = os.lstat(self._full(path))
            keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime",
                    "st_mtime", "st_ctime")  # fmt: skip
            return {key: getattr(st, key) for key in keys}

        def readdir(self, path: str, fh: Any) -> list[str]:
            return [".", "..", *os.listdir(self._full(path))]

        def open(self, path: str, flags: int) -> int:
            return os.open(self._full(path), flags)

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            return os.open(self._full(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            if self._failing(path):
                raise FuseOSError(errno.EIO)
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            return os.pwrite(fh, data, offset)

        def truncate(self, path: str, length: int, fh: Any = None) -> None:
            os.truncate(self._full(path), length)

        def flush(self, path: str, fh: int) -> None:
            return None

        def fsync(self, path: str, datasync: int, fh: int) -> None:
            os.fsync(fh)

        def release(self, path: str, fh: int) -> None:
            os.close(fh)

        def mkdir(self, path: str, mode: int) -> None:
            os.mkdir(self._full(path), mode)

        def rmdir(self, path: str) -> None:
            os.rmdir(self._full(path))

        def unlink(self, path: str) -> None:
            os.unlink(self._full(path))

        def rename(self, old: str, new: str) -> None:
            os.rename(self._full(old), self._full(new))

        def chmod(self, path: str, mode: int) -> None:
            os.chmod(self._full(path), mode)

        def utimens(self, path: str, times: Any = None) -> None:
            os.utime(self._full(path), times)

        def statfs(self, path: str) -> dict[str, Any]:
            st = os.statvfs(self._full(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                    "f_files", "f_flag", "f_frsize", "f_namemax")  # fmt: skip
            return {key: getattr(st, key) for key in keys}

    # direct_io: every read reaches this process (no page cache answers it instead).
    FUSE(Faulty(), mountpoint, foreground=True, nothreads=True, direct_io=True)


if __name__ == "__main__":
    serve(*sys.argv[1:4])
