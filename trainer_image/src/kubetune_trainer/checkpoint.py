"""Step checkpoints: `<dir>/step-<N>/`, written atomically, verified, newest loadable one resumed.

A checkpoint is written into `<dir>/.tmp-step-<N>/` by every rank (torch.distributed.checkpoint
shards plus one RNG file per rank); rank 0 adds `trainer_state.json`, the ranks checksum the
files (each rank a share), rank 0 writes `manifest.json` last, syncs, and renames the folder to
`step-<N>`. A rename within one directory is atomic on POSIX file systems (and NFS), so a
`step-<N>` folder is complete by construction, and its manifest says what "complete" was.

Contents of one checkpoint:

| file | what |
| --- | --- |
| `.metadata`, `__<rank>_0.distcp` | DCP: `model` (adapters only for LoRA/QLoRA) and `optim` |
| `trainer_state.json` | step, epoch, data position, tokens/samples seen, LR scheduler, method |
| … its `identity` | the job that wrote it and its run's fingerprint (see "Whose checkpoints") |
| `rng/rank-<r>.pt` | Python, torch CPU and CUDA RNG states of rank r |
| `manifest.json` | every other file's name, size and sha256; written last |

Under pressure:

- Before a save rank 0 compares the volume's free space with the checkpoint's expected size
  (the newest complete checkpoint's, or parameter + optimizer bytes for the first one); a save
  that would not fit is not started (quarantined checkpoints proven damaged, those that no
  longer match their manifest, are deleted first to make room) and the run ends with
  `CheckpointFailed` (exit 45), the previous checkpoint intact.
- A save that fails anyway (ENOSPC, any error, DCP's `CheckpointException`, which is a
  `BaseException`) removes its temp folder and ends the same way.
- At start-up rank 0 removes `.tmp-step-*` leftovers of interrupted saves, once it has
  claimed the folder for this attempt (kubetune_trainer.fence: one writer at a time; a stale
  attempt stops before it deletes or renames anything, and temp folders carry the attempt).
- On resume a checkpoint is checked against its manifest, then loaded; one that differs from
  its manifest (a size, a hash, a missing file) or does not load for its contents is renamed
  `step-<N>.corrupt-<UTC time>` (quarantined: never resumed, never counted by keep-K) and the
  next older one is tried. A read the storage fails (EIO, a stale NFS handle, a collective
  timed out while loading) proves nothing: `StorageUnavailable` ends the attempt with exit 1,
  nothing quarantined, and its restart reads the volume again. Pruning never removes the last
  checkpoint known to load (the one resumed or just written).

Whose checkpoints: the volume is named after the job and outlives it, so a new job of the
same name finds the old job's checkpoints. `identity` in trainer_state.json holds the writing
job's `job_uid`, `job_name`, `job_namespace`, and the `fingerprint` (sha256 of canonical JSON)
of the `fields` that shape the run (kubetune_trainer.identity). At start-up the newest
checkpoint's identity decides: this job's uid, or the uid `checkpoint.resume_from_uid` names
(adopted; later checkpoints record this job), or none recorded (an older trainer's): resumed.
Any other job's: rank 0 renames every `step-*` folder (quarantined ones too) and the output
folder, if it lies inside the checkpoint folder, into `foreign/<uid>-<UTC time>/`, and the run
starts at step 0. Nothing is deleted; `foreign/` is never resumed, counted, pruned or removed
to make room.

DCP re-shards on load, so a run re-planned onto a different number of GPUs resumes too (the
RNG of ranks that did not exist before is then seeded from the step).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from kubetune_trainer.contract import (
    CHECKPOINT_NAME,
    CHECKPOINT_PREFIX,
    CHECKPOINT_TMP_PREFIX,
    checkpoint_dir_name,
)
from kubetune_trainer.distributed import DistEnv, all_reduce_max, barrier
from kubetune_trainer.errors import CheckpointFailed, StorageUnavailable
from kubetune_trainer.fence import WriterFence
from kubetune_trainer.hashing import file_sha256
from kubetune_trainer.identity import IDENTITY_KEY

log = logging.getLogger(__name__)

T = TypeVar("T")

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 2
"""2: the checkpoint has a manifest.json (1: written before manifests; loaded unchecked)."""
MANIFEST_VERSION = 1
QUARANTINE_MARK = ".corrupt-"
SPACE_MARGIN = 1.10
"""A save needs the expected size times this, plus SPACE_SLACK_BYTES, free."""
SPACE_SLACK_BYTES = 16 * 2**20
FIX_SPACE = "To fix: raise spec.checkpoint.storage.size or lower spec.checkpoint.keep"
FOREIGN_DIR = "foreign"
"""Under the checkpoint folder: other jobs' checkpoints, moved aside (never deleted here)."""


def _is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / STATE_FILE).is_file()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = CHECKPOINT_NAME.match(p.name)
        if m and p.is_dir() and _is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def quarantined_checkpoints(root: Path) -> list[Path]:
    """`step-<N>.corrupt-<time>` folders under root, oldest quarantine first."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.name.startswith(CHECKPOINT_PREFIX) and QUARANTINE_MARK in p.name and p.is_dir()
    ]
    return sorted(found, key=lambda p: (p.name.split(QUARANTINE_MARK, 1)[1], p.name))


def _manifest_problem(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """What makes `path` differ from its manifest, checking this rank's share of the files;
    None when it matches (or predates manifests). Raises OSError (a missing file excepted)
    when a file cannot be read: that is the storage's trouble, not the checkpoint's."""
    try:
        entries = dict(json.loads((path / MANIFEST_FILE).read_text())["files"])
    except FileNotFoundError:
        try:
            version = int(json.loads((path / STATE_FILE).read_text()).get("format_version", 1))
        except FileNotFoundError:
            return f"{STATE_FILE} is missing"
        except (ValueError, TypeError, AttributeError) as e:
            return f"{STATE_FILE} is unreadable ({_first_line(e)})"
        if version >= 2:
            return f"{MANIFEST_FILE} is missing"
        log.info("%s has no manifest (written by an older trainer): not checked", path)
        return None
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST_FILE} is unreadable ({_first_line(e)})"
    for name in sorted(entries)[rank::world_size]:
        want = entries[name]
        try:
            size = (path / name).stat().st_size
            if size != int(want["size"]):
                return f"{name} has {size} bytes, its manifest says {want['size']}"
            if file_sha256(path / name) != want["sha256"]:
                return f"{name} does not match its sha256"
        except FileNotFoundError:
            return f"{name} is missing"
        except (KeyError, TypeError, ValueError) as e:
            return f"{name} cannot be checked ({_first_line(e)})"
    return None


def _still_matches(path: Path) -> bool:
    """Whether a quarantined checkpoint matches a manifest of its own (then it was not proven
    damaged, and is never removed to make room); one that cannot be read counts as matching."""
    if not (path / MANIFEST_FILE).is_file():
        return False
    try:
        return _manifest_problem(path) is None
    except OSError:
        return True


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def folder_bytes(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        with contextlib.suppress(OSError):
            if f.is_file():
                total += f.stat().st_size
    return total


def checkpoint_bytes(path: Path) -> int:
    """A checkpoint's size: its manifest's total, else the files' sizes."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        return int(manifest["total_bytes"])
    return folder_bytes(path)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, adapter_only: bool) -> int:
    """Bytes of what a checkpoint holds: saved parameters plus optimizer states (global sizes;
    a DTensor's numel is the whole tensor's)."""
    total = 0
    for p in model.parameters():
        if adapter_only and not p.requires_grad:
            continue
        total += p.numel() * p.element_size()
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def is_no_space(error: BaseException | None) -> bool:
    """Whether ENOSPC/EDQUOT is anywhere in the error, its causes, or DCP's per-rank failures."""
    todo: list[Any] = [error]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        failures = getattr(e, "failures", None)  # CheckpointException: rank → (error, trace)
        if isinstance(failures, dict):
            for value in failures.values():
                todo.append(value[0] if isinstance(value, tuple) else value)
        todo.extend([e.__cause__, e.__context__])
    return False


def _all_gather(obj: Any, env: DistEnv) -> list[Any]:
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj, group=env.control_group)
    return out


@dataclass
class Restored:
    step: int
    path: Path
    state: dict[str, Any]  # trainer_state.json


class Checkpointer:
    def __init__(
        self,
        root: str | Path,
        *,
        keep: int,
        env: DistEnv,
        adapter_only: bool,
        fence: WriterFence | None = None,
    ) -> None:
        self.root = Path(root)
        self.fence = fence
        """The folder's writer epoch (kubetune_trainer.fence): checked before every save, its
        rename and pruning, and before folders are quarantined or moved aside."""
        self.keep = max(1, keep)
        self.env = env
        self.adapter_only = adapter_only
        self.verified: Path | None = None
        """The newest checkpoint known to load: the one resumed from or the last one written.
        Pruning never removes it."""
        self.protected: int | None = None
        """The step of the best evaluation when early stopping is on: pruning never removes
        its checkpoint, since the run's output is made from it."""
        self.last_hash_seconds = 0.0
        self.last_bytes = 0
        self.full_at_step: int | None = None
        """Test fault: the free-space check before this step's save reads 0 bytes free."""

    def _options(self) -> StateDictOptions:
        # Frozen base weights are never saved for LoRA/QLoRA: they are the input model.
        return StateDictOptions(ignore_frozen_params=self.adapter_only)

    # ------------------------------------------------------------------ start-up

    def claim(self) -> None:
        """Record this attempt as the folder's writer (raises Superseded on every rank when a
        later attempt of this job already is)."""
        if self.fence is not None:
            self.fence.claim()

    def check_writer(self, what: str) -> None:
        """On every rank: raise Superseded when the folder names a later writer."""
        if self.fence is not None:
            self.fence.check(what)

    def remove_leftovers(self) -> int:
        """Rank 0 removes `.tmp-step-*` folders of interrupted saves; returns how many."""
        removed = 0
        if self.env.is_main and self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                if p.name.startswith(CHECKPOINT_TMP_PREFIX):
                    shutil.rmtree(p, ignore_errors=True)
                    removed += 1
            log.info(
                "%s: %d unfinished checkpoint folder(s) (%s*) of interrupted saves removed",
                self.root,
                removed,
                CHECKPOINT_TMP_PREFIX,
            )
        barrier()
        return removed

    def verify(self, path: Path) -> str | None:
        """Check `path` against its manifest, each rank hashing a share of the files. None when
        it matches (or predates manifests), else what is wrong: the same answer on every rank.
        A file that cannot be read (EIO, a stale NFS handle) proves nothing wrong with the
        checkpoint: StorageUnavailable on every rank, and a restart reads it again."""
        try:
            problem = _manifest_problem(path, self.env.rank, self.env.world_size)
            unreadable = None
        except OSError as e:
            problem, unreadable = None, f"{path.name}: {_first_line(e)}"
        found = _all_gather((problem, unreadable), self.env)
        cannot_read = [u for _, u in found if u]
        if cannot_read:
            raise StorageUnavailable(
                f"checkpoint {cannot_read[0]}: the volume could not be read; nothing was "
                "quarantined, and a restart reads it again. To fix: if this repeats, check "
                "the checkpoint volume (its storage, its mount on the node)"
            )
        problems = [p for p, _ in found if p]
        return problems[0] if problems else None

    def quarantine(self, path: Path, reason: str) -> Path:
        """Rank 0 renames a checkpoint that cannot be resumed to `step-<N>.corrupt-<time>`."""
        self.check_writer(f"quarantining {path.name}")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = path.with_name(f"{path.name}{QUARANTINE_MARK}{stamp}")
        if self.env.is_main:
            n = 1
            while target.exists():
                n += 1
                target = path.with_name(f"{path.name}{QUARANTINE_MARK}{stamp}-{n}")
            try:
                os.rename(path, target)
                _fsync_dir(self.root)
                log.error("checkpoint %s is damaged (%s): quarantined as %s", path.name, reason,
                          target.name)  # fmt: skip
            except OSError as e:
                log.error("checkpoint %s is damaged (%s) and cannot be renamed: %s", path.name,
                          reason, e)  # fmt: skip
                target = path
        barrier()
        return target

    def mark_verified(self, path: Path) -> None:
        self.verified = path

    def newest_identity(self) -> tuple[Path, dict[str, Any] | None] | None:
        """The newest checkpoint with a readable trainer_state.json (complete ones first, then
        quarantined ones) and its `identity` (None: an older trainer's), as rank 0 reads them:
        the same on every rank. None when there is no such checkpoint."""
        found: tuple[Path, dict[str, Any] | None] | None = None
        if self.env.is_main:
            done = [p for _, p in complete_checkpoints(self.root)]
            for path in reversed(quarantined_checkpoints(self.root) + done):
                try:
                    state = json.loads((path / STATE_FILE).read_text())
                except (OSError, ValueError):
                    continue
                saved = state.get(IDENTITY_KEY) if isinstance(state, dict) else None
                found = (path, saved if isinstance(saved, dict) else None)
                break
        result: tuple[Path, dict[str, Any] | None] | None = _all_gather(found, self.env)[0]
        return result

    def move_aside(self, uid: str, output: Path) -> tuple[Path, int]:
        """Rank 0 renames every `step-*` folder (complete, damaged, quarantined) and `output`,
        when it lies inside the checkpoint folder, into `foreign/<uid>-<UTC time>/`; nothing is
        deleted. Returns that folder and how many were moved, once every rank can see it.
        Raises CheckpointFailed (on every rank) when a rename fails."""
        self.check_writer("moving another job's checkpoints aside")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.root / FOREIGN_DIR / f"{uid}-{stamp}"
        moved = failed = 0
        if self.env.is_main:
            n = 1
            while target.exists():
                n += 1
                target = target.with_name(f"{uid}-{stamp}-{n}")
            out = output.absolute()
            inside = out != self.root.absolute() and out.is_relative_to(self.root.absolute())
            try:
                target.mkdir(parents=True)
                for p in sorted(self.root.iterdir()):
                    if p.name.startswith(CHECKPOINT_PREFIX) and p.is_dir():
                        os.rename(p, target / p.name)
                        moved += 1
                if inside and out.is_dir():
                    dest = target / out.relative_to(self.root.absolute())
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(out, dest)
                    moved += 1
                _fsync_dir(target)
                _fsync_dir(self.root)
            except OSError as e:
                log.error("cannot move the checkpoints of job uid %s to %s: %s", uid, target, e)
                failed = 1
        # Every rank waits here for rank 0's renames.
        moved, failed = all_reduce_max([moved, failed], self.env)
        if failed:
            raise CheckpointFailed(
                f"the checkpoints of another job (uid {uid}) in {self.root} could not be moved "
                f"to {target} (see the trainer log). To fix: check the checkpoint volume"
            )
        return target, moved

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        rng: dict[str, Any],
    ) -> tuple[Path, float]:
        """Write step-<step> atomically with its manifest; returns its path and the seconds it
        took. Raises CheckpointFailed (on every rank) when it cannot, leaving no temp folder and
        the previous checkpoint as it was."""
        t0 = time.monotonic()
        final = self.root / checkpoint_dir_name(step)
        tmp = self.root / f"{CHECKPOINT_TMP_PREFIX}{step}"
        if self.fence is not None:  # two attempts never share a temp folder
            tmp = tmp.with_name(f"{tmp.name}.a{self.fence.mine.attempt}")
        if self.verified == final and _is_complete(final):
            return final, 0.0  # e.g. SIGTERM right after resuming: nothing new to save
        self.check_writer(f"starting checkpoint step-{step}")
        self._make_room(step, tmp, model, optimizer)
        metadata = self._on_every_rank(
            step, tmp, "writing the shards", lambda: self._write_shards(tmp, model, optimizer, rng)
        )
        self._on_every_rank(
            step, tmp, f"writing {STATE_FILE}", lambda: self._write_state(tmp, trainer_state)
        )

        th = time.monotonic()
        names = self._file_names(tmp, metadata)
        mine = self._on_every_rank(
            step, tmp, "checksumming the files", lambda: self._checksum_share(tmp, names)
        )
        files: dict[str, Any] = {}
        for part in _all_gather(mine, self.env):
            files.update(part)
        self.last_hash_seconds = time.monotonic() - th
        self.last_bytes = sum(int(v["size"]) for v in files.values())

        self.check_writer(f"publishing checkpoint step-{step}")
        self._on_every_rank(
            step,
            tmp,
            "writing the manifest and renaming",
            lambda: self._publish(step, tmp, final, files),
        )
        self.verified = final
        self.check_writer("pruning older checkpoints")
        if self.env.is_main:
            self._prune()
        barrier()
        return final, time.monotonic() - t0

    def _on_every_rank(self, step: int, tmp: Path, what: str, fn: Callable[[], T]) -> T | None:
        """One step of a save on this rank, then `_agree`: when any rank failed, every rank
        raises CheckpointFailed. The result of `fn` (None where it failed)."""
        error: BaseException | None = None
        result: T | None = None
        try:
            result = fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            error = e
        self._agree(error, step, tmp, what)
        return result

    def _write_shards(
        self, tmp: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rng: dict[str, Any]
    ) -> Any:
        """This rank's DCP shards and RNG file; returns DCP's metadata."""
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
        metadata = dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(rng, tmp / "rng" / f"rank-{self.env.rank}.pt")
        return metadata

    def _write_state(self, tmp: Path, trainer_state: dict[str, Any]) -> None:
        if self.env.is_main:
            state = {
                "format_version": FORMAT_VERSION,
                "adapter_only": self.adapter_only,
                "world_size": self.env.world_size,
                "saved_at": time.time(),
                **trainer_state,
            }
            self._write_json(tmp / STATE_FILE, state)

    def _checksum_share(self, tmp: Path, names: list[str]) -> dict[str, Any]:
        """Size and sha256 of this rank's share of the files."""
        mine: dict[str, Any] = {}
        for name in names[self.env.rank :: self.env.world_size]:
            f = tmp / name
            mine[name] = {"size": f.stat().st_size, "sha256": file_sha256(f)}
        return mine

    def _publish(self, step: int, tmp: Path, final: Path, files: dict[str, Any]) -> None:
        """Rank 0 writes the manifest last, then renames the folder to its final name."""
        if self.env.is_main:
            manifest = {
                "manifest_version": MANIFEST_VERSION,
                "step": step,
                "algorithm": "sha256",
                "total_bytes": self.last_bytes,
                "files": dict(sorted(files.items())),
            }
            self._write_json(tmp / MANIFEST_FILE, manifest)
            _fsync_dir(tmp)
            if final.exists():  # a leftover with the final name, never verified
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)

    @staticmethod
    def _write_json(path: Path, value: dict[str, Any]) -> None:
        with path.open("w") as fh:
            json.dump(value, fh, indent=2, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())

    def _file_names(self, tmp: Path, metadata: Any) -> list[str]:
        """The checkpoint's files, known on every rank without listing a shared folder (whose
        listing NFS may cache): DCP's metadata names the shard files."""
        names = {".metadata", STATE_FILE}
        names.update(f"rng/rank-{r}.pt" for r in range(self.env.world_size))
        storage = getattr(metadata, "storage_data", None)
        if isinstance(storage, dict) and storage:
            names.update(str(info.relative_path) for info in storage.values())
        else:
            names.update(p.name for p in tmp.glob("*.distcp"))
        return sorted(names)

    def _kept(self) -> str:
        done = complete_checkpoints(self.root)
        newest = self.verified or (done[-1][1] if done else None)
        return f"{newest.name} is kept" if newest else "there is no earlier checkpoint"

    def _agree(self, error: BaseException | None, step: int, tmp: Path, what: str) -> None:
        """All ranks learn whether any failed; on failure the temp folder goes and every rank
        raises CheckpointFailed."""
        if not all_reduce_max([int(error is not None)], self.env)[0]:
            return
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        if error is None:
            cause = "another rank failed (see its log)"
        else:
            cause = f"{type(error).__name__}: {_first_line(error)}"
            log.error("checkpoint step-%d failed while %s", step, what, exc_info=error)
        hint = (
            self._fix_space()
            if is_no_space(error)
            else "To fix: check the checkpoint volume (the trainer log has the error)"
        )
        raise CheckpointFailed(
            f"checkpoint step-{step} could not be written to {self.root} ({what}): {cause}; "
            f"the temp folder was removed and {self._kept()}. {hint}"
        ) from error

    def _fix_space(self) -> str:
        foreign = self.root / FOREIGN_DIR
        if not foreign.is_dir():
            return FIX_SPACE
        return (
            f"{FIX_SPACE}, or delete what is no longer wanted in {foreign} (checkpoints of "
            "earlier jobs of this name, moved aside)"
        )

    def _make_room(
        self, step: int, tmp: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """Refuse (CheckpointFailed on every rank) to start a save that cannot fit."""
        needed = free = broken = 0
        basis = ""
        if self.env.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                needed, basis = self._estimate(model, optimizer)
                free = shutil.disk_usage(self.root).free
                for q in quarantined_checkpoints(self.root):
                    if free >= needed:
                        break
                    if _still_matches(q):  # only a checkpoint proven damaged is removed
                        log.warning("kept quarantined %s: it matches its manifest", q.name)
                        continue
                    shutil.rmtree(q, ignore_errors=True)
                    log.warning("removed quarantined checkpoint %s to make room", q.name)
                    free = shutil.disk_usage(self.root).free
                if step == self.full_at_step:
                    log.warning("the volume reads as full (simulated by faults.disk_full_at_step)")
                    free = 0
            except OSError as e:
                log.error("cannot prepare %s for a checkpoint: %s", self.root, e)
                broken = 1
        needed, free, broken = all_reduce_max([needed, free, broken], self.env)
        if broken:
            raise CheckpointFailed(
                f"checkpoint step-{step}: the checkpoint folder {self.root} cannot be prepared "
                f"(see the trainer log); {self._kept()}. To fix: check the checkpoint volume"
            )
        if free >= needed:
            return
        message = (
            f"not enough space for checkpoint step-{step} in {self.root}: needs about "
            f"{_gib(needed)} ({basis or 'estimated on rank 0'}), {_gib(free)} free; the save "
            f"was not started and {self._kept()}. {self._fix_space()}"
        )
        log.error("%s", message)
        raise CheckpointFailed(message)

    def _estimate(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, str]:
        """Bytes a new checkpoint needs, and what the estimate is based on."""
        done = complete_checkpoints(self.root)
        if done:
            size, basis = checkpoint_bytes(done[-1][1]), f"the size of {done[-1][1].name}"
        else:
            size = state_bytes(model, optimizer, self.adapter_only)
            basis = "parameter and optimizer bytes"
        return int(size * SPACE_MARGIN) + SPACE_SLACK_BYTES, basis

    def _prune(self) -> None:
        done = complete_checkpoints(self.root)
        keep = {path for _, path in done[-self.keep :]}
        if self.verified is not None:
            keep.add(self.verified)  # never the last checkpoint known to load
        keep.update(path for step, path in done if step == self.protected)
        for _, path in done:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)
        for p in self.root.iterdir():
            # Leftovers of interrupted saves; a step-N folder is only ever made complete (by
            # rename), so an incomplete one was damaged after the fact and never completes.
            broken = CHECKPOINT_NAME.match(p.name) is not None and not _is_complete(p)
            if p.name.startswith(CHECKPOINT_TMP_PREFIX) or broken:
                shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------ load

    def latest(self) -> tuple[int, Path] | None:
        done = complete_checkpoints(self.root)
        return done[-1] if done else None

    def load(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Load model/optimizer shards and this rank's RNG; returns trainer_state.json."""
        state = json.loads((path / STATE_FILE).read_text())
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
        wanted = set(model_sd)
        bundle: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp_load(bundle, checkpoint_id=str(path))
        set_state_dict(
            model,
            optimizer,
            model_state_dict=bundle["model"],
            optim_state_dict=bundle["optim"],
            options=StateDictOptions(ignore_frozen_params=self.adapter_only, strict=False),
        )
        missing = wanted - set(bundle["model"])
        if missing:
            raise RuntimeError(f"{path}: checkpoint lacks {sorted(missing)[:3]}")
        rng_file = path / "rng" / f"rank-{self.env.rank}.pt"
        if rng_file.is_file() and state.get("world_size") == self.env.world_size:
            # Tensors, tuples and ints only: nothing in a checkpoint folder runs code.
            restore_rng(torch.load(rng_file, weights_only=True))
        else:
            seed = int(state.get("seed", 0)) + int(state["step"]) * 7919 + self.env.rank
            random.seed(seed)
            torch.manual_seed(seed)
            log.warning("%s: no RNG state for rank %d; seeded from the step", path, self.env.rank)
        return dict(state)
