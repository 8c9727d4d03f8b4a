"""Stage-in throughput: S3 into the cache, against a plain boto3 `download_file` of the same.

The stage-in step (trainer_image/src/kubetune_trainer/stagein/) fetches a job's s3:// model or
dataset into the shared cache before any GPU is asked for. This benchmark times that fetch
against the plainest client a user would write, on the same objects in the same run, from a
real S3 server (versitygw, tests/support/s3server.py) on loopback:

- stage-in: `stagein.stage.stage_source(cache_dir, what, "s3", uri)`, the step's fetch/cache
  entry point for one source (what `stage_in` calls for the dataset and the model, without
  the dataset parsing, the tokenizer and the model checks that follow it): cache lookup, the
  lock, `fetch_s3` into `.tmp-<key>/` (ListObjectsV2, then `download_file` with the step's
  TransferConfig, up to 4 objects at once) and the publish (listing, entry file, rename).
  A fresh, empty cache directory each repetition.
- plain: `boto3.client("s3").download_file(bucket, key, path)` with the default TransferConfig,
  object after object, into a fresh directory.
- cache hit: `stage_source` of the same source again, into the cache the stage-in repetition
  just filled: the lookup, one HEAD (the access check a hit makes) and the `last_used` record.

Both timed regions include making their boto3 client (the step makes one per source). The
two sides alternate which goes first from one repetition to the next. Objects are random
bytes (os.urandom); the server's data directory and both download targets are in one
temporary directory on the same local filesystem, so this measures the client and cache
path on one machine, not a network. MB/s is 10^6 bytes per second; the ratio is the median
stage-in MB/s over the median plain MB/s (the project's goal: at least 0.9).

Usage: python -m benchmarks.stage_in [--reps N] [--quick] [--workdir DIR]
           [--out FILE | --no-write]

Needs versitygw, built from Go modules on first use and cached (docs/data.md, "Testing with a
local S3 store"); without Go it says why and exits 0 without writing results.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.measure import proc_kib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # support.s3server, support.binaries

MiB = 1024**2
BUCKET = "bench"


@dataclass(frozen=True)
class Case:
    """One source: `count` objects of `mib` MiB each, under a prefix or as one object."""

    name: str
    what: str  # "model" or "dataset": the stage-in kind it is staged as
    count: int
    mib: int

    @property
    def single(self) -> bool:
        return self.count == 1

    @property
    def prefix(self) -> str:
        return f"{self.name}.bin" if self.single else f"{self.name}/"

    def object_keys(self) -> list[str]:
        if self.single:
            return [self.prefix]
        return [
            f"{self.prefix}model-{i + 1:05d}-of-{self.count:05d}.safetensors"
            for i in range(self.count)
        ]

    @property
    def uri(self) -> str:
        return f"s3://{BUCKET}/{self.prefix}".rstrip("/")

    @property
    def nbytes(self) -> int:
        return self.count * self.mib * MiB

    @property
    def label(self) -> str:
        shape = f"1 × {self.mib} MiB" if self.single else f"{self.count} × {self.mib} MiB"
        return f"{self.name} ({shape}, as a {self.what})"


FULL = (
    Case("object-64", "dataset", 1, 64),
    Case("object-256", "dataset", 1, 256),
    Case("shards-8x32", "model", 8, 32),
)
QUICK = (Case("object-16", "dataset", 1, 16), Case("shards-4x8", "model", 4, 8))


@dataclass
class Times:
    stage_s: list[float] = field(default_factory=list)
    plain_s: list[float] = field(default_factory=list)
    hit_s: list[float] = field(default_factory=list)
    hit_ops: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- measuring


def make_sources(cases: tuple[Case, ...], src: Path) -> dict[str, str]:
    """Write each case's objects as random bytes under `src`; their sha256 by key."""
    digests = {}
    for case in cases:
        for key in case.object_keys():
            path = src / key
            path.parent.mkdir(parents=True, exist_ok=True)
            h = hashlib.sha256()
            with path.open("wb") as fh:
                for _ in range(case.mib):
                    chunk = os.urandom(MiB)
                    h.update(chunk)
                    fh.write(chunk)
            digests[key] = h.hexdigest()
    return digests


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The step prints a JSON line per file to stdout; not into the table."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def run_stage(case: Case, cache: Path) -> tuple[float, Path]:
    from kubetune_trainer.stagein.stage import stage_source

    with quiet():
        t0 = time.perf_counter()
        staged = stage_source(cache, case.what, "s3", case.uri)
        seconds = time.perf_counter() - t0
    if staged.downloaded_bytes != case.nbytes:
        raise RuntimeError(f"{case.name}: stage-in downloaded {staged.downloaded_bytes} bytes")
    return seconds, Path(staged.path)


def run_hit(case: Case, cache: Path, server: Any) -> tuple[float, str]:
    from kubetune_trainer.stagein.stage import stage_source

    before = len(server.requests())
    with quiet():
        t0 = time.perf_counter()
        staged = stage_source(cache, case.what, "s3", case.uri)
        seconds = time.perf_counter() - t0
    if staged.downloaded_bytes != 0:
        raise RuntimeError(f"{case.name}: a cache hit downloaded {staged.downloaded_bytes} bytes")
    ops = "+".join(r.operation for r in server.requests()[before:]) or "none"
    return seconds, ops


def run_plain(case: Case, dest: Path, server: Any) -> float:
    t0 = time.perf_counter()
    client = server.client()
    for key in case.object_keys():
        path = dest / key
        path.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(BUCKET, key, str(path))
    return time.perf_counter() - t0


def verify(case: Case, staged: Path, plain: Path, digests: dict[str, str]) -> None:
    """Both sides got every byte of every object (checked once, outside the timing)."""
    for key in case.object_keys():
        mine = staged if case.single else staged / key.removeprefix(case.prefix)
        for path in (mine, plain / key):
            if sha256(path) != digests[key]:
                raise RuntimeError(f"{case.name}: {path} differs from s3://{BUCKET}/{key}")


def measure(
    cases: tuple[Case, ...], reps: int, server: Any, work: Path, digests: dict[str, str]
) -> dict[str, Times]:
    results = {case.name: Times() for case in cases}
    # Warm-up, not counted: botocore's service model, the step's session, the first
    # connections; the smallest case, once each way.
    warm = min(cases, key=lambda c: c.nbytes)
    run_stage(warm, work / "warm-cache")
    run_plain(warm, work / "warm-plain", server)
    shutil.rmtree(work / "warm-cache")
    shutil.rmtree(work / "warm-plain")
    for rep in range(reps):
        for case in cases:
            cache = work / f"cache-{case.name}-{rep}"
            plain = work / f"plain-{case.name}-{rep}"
            times = results[case.name]
            order = ("stage", "plain") if rep % 2 == 0 else ("plain", "stage")
            staged = None
            for side in order:
                if side == "stage":
                    seconds, staged = run_stage(case, cache)
                    times.stage_s.append(seconds)
                else:
                    times.plain_s.append(run_plain(case, plain, server))
            seconds, ops = run_hit(case, cache, server)
            times.hit_s.append(seconds)
            times.hit_ops.append(ops)
            assert staged is not None
            if rep == 0:
                verify(case, staged, plain, digests)
            shutil.rmtree(cache)
            shutil.rmtree(plain)
            print(
                f"  rep {rep + 1}/{reps} {case.name}: stage-in {times.stage_s[-1]:.2f}s, "
                f"plain {times.plain_s[-1]:.2f}s, hit {1000 * times.hit_s[-1]:.0f} ms",
                flush=True,
            )
    return results


# --------------------------------------------------------------------------- the machine


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return "?"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else "?"


def machine(work: Path, binary: Path) -> dict[str, str]:
    import boto3
    import botocore
    import s3transfer

    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = "?"
    with contextlib.suppress(OSError, ValueError, IndexError, KeyError):
        ram = f"{proc_kib('/proc/meminfo', ('MemTotal',))['MemTotal'] / 1024**2:.0f} GiB"
    disk = _first_line(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "-T", str(work)])
    usage = shutil.disk_usage(work)
    versity = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
        versity = (
            " ".join(
                line.split(":", 1)[1].strip()
                for line in out.splitlines()
                if line.startswith("Version")
            )
            or "?"
        )
    return {
        "cores": f"{os.cpu_count()} cores ({cpu}, {platform.machine()})",
        "ram": ram,
        "disk": f"{disk}, {usage.total / 1e9:.0f} GB ({usage.free / 1e9:.0f} GB free)",
        "python": platform.python_version(),
        "boto3": f"boto3 {boto3.__version__}, botocore {botocore.__version__}, "
        f"s3transfer {s3transfer.__version__}",
        "versitygw": f"{versity} (posix backend)",
        "commit": _first_line(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
    }


# --------------------------------------------------------------------------- report


def mbps(nbytes: int, seconds: list[float]) -> list[float]:
    return [nbytes / 1e6 / s for s in seconds]


def summary(cases: tuple[Case, ...], results: dict[str, Times]) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        t = results[case.name]
        stage, plain = mbps(case.nbytes, t.stage_s), mbps(case.nbytes, t.plain_s)
        ops = sorted(set(t.hit_ops))
        rows.append(
            {
                "case": case,
                "stage": (statistics.median(stage), min(stage), max(stage)),
                "plain": (statistics.median(plain), min(plain), max(plain)),
                "ratio": statistics.median(stage) / statistics.median(plain),
                "hit_ms": [1000 * s for s in t.hit_s],
                "hit_ops": ", ".join(ops),
                "reps": len(t.stage_s),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| source | reps | stage-in MB/s median (min–max) | plain MB/s median (min–max) "
        "| stage-in / plain | cache hit ms median (max) | hit's requests |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        s, p, hits = r["stage"], r["plain"], r["hit_ms"]
        lines.append(
            f"| {r['case'].label} | {r['reps']} | {s[0]:.0f} ({s[1]:.0f}–{s[2]:.0f}) "
            f"| {p[0]:.0f} ({p[1]:.0f}–{p[2]:.0f}) | {r['ratio']:.2f} "
            f"| {statistics.median(hits):.0f} ({max(hits):.0f}) | {r['hit_ops']} |"
        )
    return lines


def reading(rows: list[dict[str, Any]]) -> str:
    ratios = ", ".join(f"{r['case'].name} {r['ratio']:.2f}" for r in rows)
    worst = min(r["ratio"] for r in rows)
    verdict = "meets" if worst >= 0.9 else "misses"
    hits = [h for r in rows for h in r["hit_ms"]]
    overlap = [
        r["case"].name
        for r in rows
        if r["stage"][1] <= r["plain"][2] and r["plain"][1] <= r["stage"][2]
    ]
    spread = (
        "In every row the two sides' min–max ranges overlap: the differences between the "
        "ratios are within this shared machine's run-to-run spread. "
        if len(overlap) == len(rows)
        else f"The two sides' min–max ranges overlap for {', '.join(overlap) or 'none'}. "
    )
    return (
        f"Stage-in / plain, median against median: {ratios}; the lowest, {worst:.2f}, "
        f"{verdict} the goal of 0.9. {spread}The step uses 16 MiB parts, 8 threads per "
        "object and 4 objects at once where plain boto3 uses 8 MiB parts, 10 threads and "
        "one object at a time; on top of the download it lists the prefix, takes the cache "
        "lock and publishes the entry (a listing of the files, the entry file, one rename). "
        "Everything runs on one machine (the server's reads come from the page cache, the "
        "writes go to it, both sides compete with the server for the same cores), so "
        "these numbers are the client and cache path's own cost on a CPU-bound machine; "
        "what a network adds is not in them. A cache hit costs "
        f"{statistics.median(hits):.0f} ms median ({max(hits):.0f} ms at most): the "
        "lookup, one HEAD request and the `last_used` record, whatever the size."
    )


def report(
    rows: list[dict[str, Any]], facts: dict[str, str], command: str, date: str, load: str
) -> str:
    lines = [
        f"# Stage-in throughput — {date}",
        "",
        f"Made by `{command}`, the stage-in code as of commit {facts['commit']}.",
        "",
        f"- Machine: {facts['cores']}, {facts['ram']} RAM, disk {facts['disk']}; "
        f"Python {facts['python']}; {facts['boto3']}; versitygw {facts['versitygw']}. "
        f"1-minute load average {load}; other work shared the machine.",
        "- The S3 server (versitygw on 127.0.0.1) keeps its data on this local disk, and both "
        "sides download to the same filesystem: this measures the client and cache path, not "
        "a network.",
        "- stage-in: `kubetune_trainer.stagein.stage.stage_source(cache_dir, what, 's3', "
        "uri)` into a fresh cache each repetition: the lookup, the lock, `fetch_s3` "
        "(ListObjectsV2, `download_file` with the step's TransferConfig: 16 MiB parts, 8 "
        "threads, 4 objects at once) and the publish (entry file, rename). Not timed: the "
        "dataset parsing, tokenizing and model checks `stage_in` does after it.",
        "- plain: `boto3.client('s3').download_file(...)` with the default TransferConfig "
        "(8 MiB parts, 10 threads), one object after another, into a fresh directory.",
        "- Both timings include making the boto3 client; the sides alternate which goes first. "
        "Objects are random bytes (os.urandom); every byte of both downloads was checked "
        "against the source (sha256) in the first repetition. MB/s = 10^6 bytes/s; the "
        "ratio is median against median.",
        "- cache hit: the same `stage_source` again on the filled cache; the requests column "
        "is what the S3 server's access log saw during it.",
        "",
        *table(rows),
        "",
        reading(rows),
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def server_binary() -> Path | None:
    from kubetune_dev.binaries import NoGoError
    from support.binaries import s3_server_binary

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        binary: Path = s3_server_binary(say)
    except NoGoError as exc:
        print(f"the S3 server (versitygw) is not built and cannot be: {exc}; no results")
        return None
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, help="repetitions of each source (default 15)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small objects (16 MiB, 4 × 8 MiB), 2 reps; prints only",
    )
    parser.add_argument(
        "--workdir", type=Path, help="where the temporary directory goes (default: $TMPDIR)"
    )
    parser.add_argument("--out", type=Path, help="results file (default: dated, in results/)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    binary = server_binary()
    if binary is None:
        return
    from support.s3server import s3_server

    cases = QUICK if args.quick else FULL
    reps = args.reps or (2 if args.quick else 15)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="stage-in-bench-", dir=args.workdir) as tmp:
        work = Path(tmp)
        facts = machine(work, binary)
        with s3_server(work, binary=binary) as server:
            os.environ.update(server.env())  # what the step's S3 client reads
            print(f"writing {sum(c.nbytes for c in cases) / MiB:.0f} MiB of random objects")
            digests = make_sources(cases, work / "src")
            server.make_bucket(BUCKET)
            server.put_tree(BUCKET, "", work / "src")
            shutil.rmtree(work / "src")
            print(f"{len(cases)} sources × {reps} repetitions")
            results = measure(cases, reps, server, work, digests)
    load = f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    rows = summary(cases, results)
    command = " ".join(["python -m benchmarks.stage_in", *sys.argv[1:]])
    text = report(rows, facts, command, date, load)
    print()
    print(text)
    if not (args.no_write or args.quick):
        out = args.out or HERE / "results" / f"stage-in-{date}.md"
        out.parent.mkdir(exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
