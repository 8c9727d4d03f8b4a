"""Build everything the test tiers build on first use, ahead of them.

On a fresh machine the trainer tier builds llama.cpp's bindings, and the integration and e2e
tiers build the control plane and the tests' S3 server, each when it first needs one. CI runs
this in the background at low priority while lint and the unit tier run, so that the builds
use the cores those leave idle. Every build holds its own lock: a tier that needs a build
still running waits for it, and builds it itself if this process failed.

Command line::

    python -m kubetune_dev.prebuild           # build whatever is missing, in the order needed
    python -m kubetune_dev.prebuild --ready   # exit 0 when nothing is missing (builds nothing)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from kubetune_dev import binaries, llamacpp


def _say(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def _control_plane() -> None:
    binaries.ensure_binaries(_say)


def _s3_server() -> None:
    binaries.ensure_s3_server(_say)


def _llama_cpp() -> None:
    llamacpp.ensure_llama_cpp(progress=_say)


def _control_plane_ready() -> bool:
    plan = binaries.make_plan()
    return binaries.is_complete(plan.bin_dir, plan.expected())


#: In the order the tiers need them: the trainer tier runs first (llama.cpp), then the
#: integration tier (control plane, S3 server).
BUILDS: tuple[tuple[str, Callable[[], bool], Callable[[], None]], ...] = (
    ("llama.cpp bindings", lambda: llamacpp.cached() is not None, _llama_cpp),
    ("control plane", _control_plane_ready, _control_plane),
    ("S3 server", binaries.s3_server_ready, _s3_server),
)


def missing() -> list[str]:
    return [name for name, ready, _ in BUILDS if not ready()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kubetune_dev.prebuild",
        description="Build what the test tiers would build on first use.",
    )
    parser.add_argument(
        "--ready", action="store_true", help="exit 0 when everything is built, 1 otherwise"
    )
    args = parser.parse_args(argv)
    if args.ready:
        todo = missing()
        if todo:
            print(f"not built yet: {', '.join(todo)}", file=sys.stderr)
        return 1 if todo else 0
    failed = []
    for name, ready, build in BUILDS:
        if ready():
            _say(f"{name}: cached")
            continue
        start = time.monotonic()
        _say(f"{name}: building")
        try:
            build()
        except Exception as exc:  # the tier that needs it builds it again
            failed.append(name)
            _say(f"{name}: failed ({exc}); the tier that needs it will build it again")
            continue
        _say(f"{name}: built in {time.monotonic() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
