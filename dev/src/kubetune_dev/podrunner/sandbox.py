"""The container side: what the helper process does to become a container's process.

The runner starts `python -m kubetune_dev.podrunner --exec-container FILE` for each container;
that helper reads the `ExecSpec` in FILE and calls `exec_container`: private mount, UTS and PID
namespaces (unshare through ctypes), the bind mounts planned by volumes.py, the hostname, the
working directory, then the command forked as PID 1 of the new PID namespace (`_run_as_init`),
or exec'ed directly where there is no PID namespace. Without CAP_SYS_ADMIN it falls back to
the path map in $KUBETUNE_PATH_MAP. `probe_mount_namespace` tells the runner up front which
of the two it will get. Linux only, and the only module that calls libc through ctypes.

A container whose mount point is missing on the host (`/cache`, `/checkpoints`) gets it
created there, and the runner removes it again once it is unused. Every pod runner of the
machine (one per node, and the nodes of several local clusters) shares the host's root, and
removing a directory that is a mount point in another mount namespace detaches that mount
(Linux ≥ 3.18): the other container would go on writing to a new, empty folder of the host.
So "unused" is machine-wide: each container holds a shared lock on one file for as long as
any of its processes lives (`hold_mount_points`), records the points it created in a folder
beside it, and a runner removes them only when it can take that lock exclusively
(`remove_unused_mount_points`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn

from kubetune_dev.podrunner.volumes import Mount, map_path, path_depth, path_map

PATH_MAP_ENV = "KUBETUNE_PATH_MAP"
START_ERROR_EXIT = 128
MOUNT_POINTS_ENV = "KUBETUNE_PODRUNNER_MOUNT_POINTS"
"""Where the machine-wide lock and record of created mount points live (tests set it)."""


def mount_points_dir() -> Path:
    return Path(os.environ.get(MOUNT_POINTS_ENV) or "/run/kubetune-podrunner")


@dataclass
class ExecSpec:
    """Everything the helper process needs to become the container's process."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    hostname: str
    mounts: list[Mount]
    namespace: bool
    """Use a private mount + UTS namespace (bind mounts, hostname); else the path map."""
    created_file: str
    """Where the helper records the mount points it had to create on the host."""
    error_file: str
    """Where the helper records why the command could not be started."""
    parent_pid: int = 0
    mount_points: str = ""
    """The machine-wide folder of `hold_mount_points` (empty: take no lock)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ExecSpec:
        raw = json.loads(text)
        raw["mounts"] = [Mount(**m) for m in raw["mounts"]]
        return cls(**raw)


_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWPID = 0x20000000
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_RDONLY = 1
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
    ]
    return libc


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_namespace(hostname: str | None, *, pid: bool = False) -> None:
    """unshare(CLONE_NEWNS|CLONE_NEWUTS[|CLONE_NEWPID]), make every mount private, set the
    hostname. With `pid`, the next child of the caller is PID 1 of a new PID namespace."""
    libc = _libc()
    flags = _CLONE_NEWNS | (_CLONE_NEWUTS if hostname else 0) | (_CLONE_NEWPID if pid else 0)
    _check(libc.unshare(flags), "unshare")
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    if hostname:
        socket.sethostname(hostname)


def _ensure_target(target: str, is_dir: bool, covered: Sequence[str]) -> list[str]:
    """Create a missing mount point (and parents); return those created outside earlier mounts."""
    created: list[str] = []
    parts = PurePosixPath(target).parts
    for i in range(1, len(parts) + 1):
        path = str(PurePosixPath(*parts[:i]))
        if os.path.lexists(path):
            continue
        last = i == len(parts)
        if last and not is_dir:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
        else:
            os.mkdir(path, 0o755)
        inside = any(path == c or path.startswith(c.rstrip("/") + "/") for c in covered)
        if not inside:
            created.append(path)
    return created


def hold_mount_points(folder: str) -> None:
    """Take the machine-wide shared lock for this process and every process it becomes or
    starts (the descriptor survives exec), before any mount point is created: no runner
    removes mount points while one is held."""
    Path(folder, "created").mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(folder, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.set_inheritable(fd, True)


def remove_unused_mount_points(folder: str | Path) -> bool:
    """Remove the empty mount points containers created on the host, if no container of any
    runner of the machine runs; False (nothing removed) while one does."""
    lock = Path(folder, "lock")
    if not lock.exists():
        return True
    fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        records = sorted(Path(folder, "created").glob("*.json"))
        paths: set[str] = set()
        for record in records:
            with contextlib.suppress(OSError, ValueError):
                paths.update(json.loads(record.read_text() or "[]"))
        for path in sorted(paths, key=path_depth, reverse=True):
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)  # only if empty: what a container left there stays
                elif os.path.isfile(path) and os.path.getsize(path) == 0:
                    os.unlink(path)
        for record in records:
            record.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def bind_mounts(mounts: Sequence[Mount]) -> list[str]:
    """Bind every mount (in the current, private namespace); returns host paths created.

    Sources are opened first: a mount may hide a later source (an emptyDir over /tmp hides a
    volume folder under /tmp), and an O_PATH descriptor still reaches it.
    """
    libc = _libc()
    opened = []
    for m in mounts:
        fd = os.open(m.source, os.O_PATH | os.O_CLOEXEC)
        opened.append((fd, os.path.isdir(m.source), m))
    created: list[str] = []
    covered: list[str] = []
    try:
        for fd, is_dir, m in opened:
            created += _ensure_target(m.target, is_dir, covered)
            src = f"/proc/self/fd/{fd}".encode()
            _check(
                libc.mount(src, m.target.encode(), None, _MS_BIND | _MS_REC, None),
                f"bind mount {m.source} at {m.target}",
            )
            if m.read_only:
                _check(
                    libc.mount(
                        None, m.target.encode(), None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY, None
                    ),
                    f"read-only remount of {m.target}",
                )
            covered.append(m.target)
    finally:
        for fd, _, _ in opened:
            os.close(fd)
    return created


_FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def _exec(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> NoReturn:
    os.chdir(cwd)
    program = argv[0]
    if "/" not in program and shutil.which(program, path=env.get("PATH", "")) is None:
        raise FileNotFoundError(f'exec: "{program}": executable file not found in $PATH')
    os.execvpe(program, list(argv), dict(env))


def _report_start_error(error_fd: int, exc: BaseException) -> NoReturn:
    plain = isinstance(exc, FileNotFoundError) and not exc.errno
    message = str(exc) if plain else f"{type(exc).__name__}: {exc}"
    os.write(error_fd, message.encode())
    os._exit(START_ERROR_EXIT)


def _run_as_init(argv: Sequence[str], env: Mapping[str, str], cwd: str, error_fd: int) -> NoReturn:
    """Fork the command as PID 1 of the new PID namespace, relay signals to it, and end the
    same way it ends. When PID 1 dies the kernel kills everything left in the namespace, as
    when a container stops (torchrun starts its workers in sessions of their own: a
    process-group kill would miss them)."""
    child = [0]
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if child[0] > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0], signum)
        else:
            pending.append(signum)

    for sig in _FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    pid = os.fork()
    if pid == 0:
        try:
            _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # The namespace's own /proc, so that `ps` and /proc/<pid> agree with getpid().
            with contextlib.suppress(OSError):
                _check(
                    _libc().mount(
                        b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None
                    ),
                    "mount /proc",
                )
            _exec(argv, env, cwd)
        except (OSError, ValueError, IndexError) as exc:
            _report_start_error(error_fd, exc)
    child[0] = pid
    for early in pending:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, early)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        died_of = os.WTERMSIG(status)
        if died_of not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(died_of, signal.SIG_DFL)
        os.kill(os.getpid(), died_of)  # end by the same signal: the runner sees 128+N
        os._exit(128 + died_of)
    os._exit(os.waitstatus_to_exitcode(status))


def exec_container(spec: ExecSpec) -> NoReturn:
    """Become the container's process: namespaces, mounts, hostname, cwd, then exec (or, in a
    PID namespace, fork the command as its PID 1 and wait for it)."""
    # Both files may be hidden by the mounts below, so open them first.
    error_fd = os.open(spec.error_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC)
    env = dict(spec.env)
    try:
        if spec.mount_points:  # before the record of what is created, in its folder
            hold_mount_points(spec.mount_points)
        created_fd = os.open(
            spec.created_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        )
        libc = _libc()
        # Die with the runner even if it is SIGKILLed (survives exec); no orphans.
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if spec.parent_pid and os.getppid() != spec.parent_pid:
            os._exit(137)
        isolated = own_pids = False
        if spec.namespace:
            try:
                try:
                    enter_namespace(spec.hostname, pid=True)
                    own_pids = True
                except OSError:
                    enter_namespace(spec.hostname)
                isolated = True
            except OSError as exc:
                print(
                    f"podrunner: no private mount namespace ({exc}); volumes are not at their "
                    f"mount paths, ${PATH_MAP_ENV} maps them",
                    file=sys.stderr,
                    flush=True,
                )
        cwd = spec.cwd or "/"
        created: list[str] = []
        if isolated:
            created = bind_mounts(spec.mounts)
        else:
            mapping = path_map(spec.mounts)
            env[PATH_MAP_ENV] = json.dumps(mapping)
            cwd = map_path(cwd, mapping)
        # Runtimes create a missing workingDir; one made on the host is removed later.
        created += _ensure_target(cwd, True, [m.target for m in spec.mounts] if isolated else [])
        os.write(created_fd, json.dumps(created).encode())
        os.close(created_fd)
        if own_pids:
            _run_as_init(spec.argv, env, cwd, error_fd)
        _exec(spec.argv, env, cwd)
    except (OSError, ValueError, IndexError) as exc:
        _report_start_error(error_fd, exc)


def probe_mount_namespace() -> str | None:
    """None if a private mount namespace with bind mounts works here, else why not."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(read)
        try:
            enter_namespace(None)
            os.write(write, b"ok")
        except BaseException as exc:
            os.write(write, str(exc).encode()[:500])
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as r:
        answer = r.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return None if answer == "ok" else answer or "unknown error"
