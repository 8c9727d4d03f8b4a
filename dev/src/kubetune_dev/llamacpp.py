"""Build, cache and locate llama-cpp-python and llama.cpp's GGUF converter for the tests.

The GGUF tests load what ``kubetune_trainer.gguf`` writes with a real llama.cpp runtime. Both
come from one file, the llama-cpp-python source distribution on PyPI: its ``vendor/llama.cpp``
holds ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/`` (copied as they are), and pip
builds the bindings (libllama, CPU only) from it with cmake. Nothing is taken from GitHub.

Everything lands in ``${XDG_CACHE_HOME:-~/.cache}/kubetune/llama-cpp-python-<version>-r<recipe>/``:
``site/`` (``pip install --target``: the ``llama_cpp`` package and ``diskcache``, which it
imports), ``converter/`` and a ``.manifest.json`` with the build time. A ``.complete`` stamp
marks a finished build; a missing stamp means build again, under a lock so that two processes
do not build at once. The sdist is checked against its pinned sha256.

Command line::

    python -m kubetune_dev.llamacpp build   # build what is missing, print the cache dir
    python -m kubetune_dev.llamacpp path    # print the cache dir (builds nothing)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: llama-cpp-python release: the bindings and, in its vendor/llama.cpp, the converter.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: diskcache, which llama_cpp imports; installed next to it.
DISKCACHE_VERSION = "5.6.3"
#: Bump when the build recipe (cmake flags, the source edit, what is copied) changes.
RECIPE = 2
#: CPU only, no multimodal library, no -march=native: a cache restored on another CPU works.
CMAKE_ARGS = "-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF"
#: llama-cpp-python's CMakeLists.txt forces llama.cpp's `common` library on (argument parsing,
#: chat templates, JSON: a third of the compile) for its multimodal library. The bindings load
#: libllama and ggml only, and the multimodal library is off, so the build turns it off again:
#: this one line of the sdist is edited before pip builds it.
COMMON_ON = 'set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'
COMMON_OFF = 'set(LLAMA_BUILD_COMMON OFF CACHE BOOL "Build llama.cpp common library" FORCE)'
#: What the converter needs from vendor/llama.cpp.
CONVERTER_PARTS: tuple[str, ...] = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
#: Where a copy of the sdist may already be (a directory), before PyPI is asked.
SDIST_DIR_ENV = "KUBETUNE_LLAMA_CPP_SDIST_DIR"

STAMP_NAME = ".complete"
MANIFEST_NAME = ".manifest.json"
LOCK_NAME = ".lock"

Progress = Callable[[str], None]


class BuildError(RuntimeError):
    """llama-cpp-python could not be fetched or built; the message says why."""


@dataclass(frozen=True)
class LlamaCpp:
    root: Path
    #: Put on sys.path (or PYTHONPATH) to import llama_cpp.
    site_dir: Path
    #: convert_hf_to_gguf.py, conversion/ and gguf-py/: kubetune_trainer.gguf's converter dir.
    converter_dir: Path
    #: Seconds the build took when it was made (from the manifest).
    build_seconds: float


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kubetune" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}-r{RECIPE}"


def cached() -> LlamaCpp | None:
    """The finished build, or None (builds nothing)."""
    root = cache_root()
    if not (root / STAMP_NAME).is_file():
        return None
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    return LlamaCpp(
        root=root,
        site_dir=root / "site",
        converter_dir=root / "converter",
        build_seconds=float(manifest.get("build_seconds", 0.0)),
    )


def ensure_llama_cpp(progress: Progress | None = None) -> LlamaCpp:
    """Build once into the cache (under a lock), reuse afterwards."""
    say = progress or (lambda _msg: None)
    found = cached()
    if found is not None:
        return found
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / LOCK_NAME):
        found = cached()  # another process built it while this one waited
        if found is not None:
            return found
        _build(root, say)
    found = cached()
    assert found is not None
    return found


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(root: Path, say: Progress) -> None:
    for part in ("site", "converter", STAMP_NAME, MANIFEST_NAME):
        target = root / part
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    with tempfile.TemporaryDirectory(prefix="llama-cpp-") as tmp:
        sdist = _sdist(Path(tmp), say)
        say(f"extracting llama.cpp's converter from {sdist.name}")
        _extract_converter(sdist, root / "converter")
        source = _source_without_common(sdist, Path(tmp) / "src")
        say(f"building llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (cmake, CPU only)")
        start = time.monotonic()
        env = {
            **os.environ,
            "CMAKE_ARGS": CMAKE_ARGS,
            "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1),
        }
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--target",
            str(root / "site"),
            str(source),
            f"diskcache=={DISKCACHE_VERSION}",
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise BuildError(f"building llama-cpp-python failed after {seconds:.0f}s:\n{tail}")
    manifest = {
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "sdist_sha256": SDIST_SHA256,
        "recipe": RECIPE,
        "cmake_args": CMAKE_ARGS,
        "build_seconds": round(seconds, 1),
        "cpus": os.cpu_count(),
    }
    (root / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    (root / STAMP_NAME).write_text("")
    say(f"llama-cpp-python built in {seconds:.0f}s into {root}")


def _sdist(tmp: Path, say: Progress) -> Path:
    """The pinned sdist: from $KUBETUNE_LLAMA_CPP_SDIST_DIR if there, else from PyPI."""
    local = os.environ.get(SDIST_DIR_ENV)
    if local and (Path(local) / SDIST_NAME).is_file():
        path = Path(local) / SDIST_NAME
    else:
        say(f"downloading {SDIST_NAME} from PyPI")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            "-d",
            str(tmp),
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        path = tmp / SDIST_NAME
        if proc.returncode != 0 or not path.is_file():
            raise BuildError(f"pip download failed: {(proc.stdout + proc.stderr)[-2000:]}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise BuildError(f"{path} has sha256 {digest}, not the pinned {SDIST_SHA256}")
    return path


def _source_without_common(sdist: Path, dest: Path) -> Path:
    """The sdist unpacked into `dest`, its CMakeLists.txt building no `common` library."""
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    source = dest / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    cmake = source / "CMakeLists.txt"
    text = cmake.read_text()
    if text.count(COMMON_ON) != 1:
        raise BuildError(f"{sdist.name}: CMakeLists.txt no longer has the line `{COMMON_ON}`")
    cmake.write_text(text.replace(COMMON_ON, COMMON_OFF))
    return source


def _extract_converter(sdist: Path, dest: Path) -> None:
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    wanted = tuple(prefix + part for part in CONVERTER_PARTS)
    staging = dest.with_name(dest.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if (m.isfile() or m.isdir()) and (m.name in wanted or m.name.startswith(wanted))
        ]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(staging, members=members, filter="data")
    missing = [p for p in CONVERTER_PARTS if not (staging / p).exists()]
    if missing:
        raise BuildError(f"{sdist.name} has no vendor/llama.cpp/{', '.join(missing)}")
    staging.rename(dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetune_dev.llamacpp")
    parser.add_argument("command", choices=["build", "path"])
    args = parser.parse_args(argv)
    if args.command == "path":
        print(cache_root())
        return 0
    built = ensure_llama_cpp(progress=lambda msg: print(msg, file=sys.stderr))
    print(built.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
