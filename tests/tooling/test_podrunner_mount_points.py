"""Mount points a container created on the host are removed only when no container of any
runner of the machine runs: removing one that is a mount point in another container's
namespace would detach that container's volume (it would write to a new, empty folder)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kubetune_dev.podrunner.sandbox import remove_unused_mount_points

HOLD = """
import sys
from kubetune_dev.podrunner.sandbox import hold_mount_points
hold_mount_points(sys.argv[1])
print("held", flush=True)
sys.stdin.read()  # until the test closes it
"""


def _created(folder: Path, *paths: Path) -> None:
    """What a container that has ended left: its record, and the lock file (unlocked)."""
    (folder / "created").mkdir(parents=True)
    (folder / "lock").touch()
    (folder / "created" / "one.json").write_text(json.dumps([str(p) for p in paths]))


def test_a_running_container_anywhere_keeps_the_mount_points(tmp_path: Path) -> None:
    folder, point = tmp_path / "run", tmp_path / "cache"
    point.mkdir()
    # Another runner's container: a process that holds the shared lock while it lives.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (folder / "created" / "one.json").write_text(json.dumps([str(point)]))
        assert remove_unused_mount_points(folder) is False
        assert point.is_dir()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    assert remove_unused_mount_points(folder) is True
    assert not point.exists() and not list((folder / "created").iterdir())


def test_only_empty_points_are_removed_deepest_first(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    outer, inner, kept = tmp_path / "a", tmp_path / "a" / "b", tmp_path / "kept"
    inner.mkdir(parents=True)
    kept.mkdir()
    (kept / "written-by-a-container").write_text("x")
    _created(folder, outer, inner, kept)
    assert remove_unused_mount_points(folder) is True
    assert not outer.exists()
    assert (kept / "written-by-a-container").is_file()
