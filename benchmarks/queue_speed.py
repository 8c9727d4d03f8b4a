"""Queue speed: what the operator's GPU queue costs a burst of N waiting jobs.

Every look at a job that waits for GPUs asks the queue how many jobs of its pool go first
(`GpuQueue.admit`), and every change of capacity asks for the front of each pool's queue
(`GpuQueue.heads`). A burst of N jobs asks both about N times, so a queue that scans every
waiting job per question costs N² in all: at 5,000 jobs 25 times what 1,000 cost.

This benchmark times a burst against `controller.gpuqueue.GpuQueue` (each pool's waiting jobs
kept sorted: a bisection per question) and against `ScanQueue` below, the same rules asked by
scanning every waiting job (`control.queue.count_ahead`, a sort for the heads), as the queue
did before. The burst: N jobs over 4 pools, random priorities and creation times from a fixed
seed; each job is first queued by its plan (`queued=True`), then looked at again with no free
GPU (`queued=False`); the heads of every queue are asked after every 10 looks. Both queues
must give every job the same positions, which the benchmark checks.

Usage: python benchmarks/queue_speed.py [--sizes 1000,5000,10000] [--out FILE | --no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kubetune.control.queue import Ticket, count_ahead
from kubetune.controller.gpuqueue import GpuQueue

HERE = Path(__file__).resolve().parent
SEED = 20261125
POOLS = ("rtx4090-spot", "l40s", "a100-80gb", "h100")
HEADS_EVERY = 10
PER_POOL = 8  # the operator's WAKE_PER_POOL


class ScanQueue:
    """The queue's rules answered by scanning every waiting job (the reference)."""

    def __init__(self) -> None:
        self.waiting: dict[tuple[str, str], Ticket] = {}

    def admit(self, key: tuple[str, str], ticket: Ticket, free: Sequence[int], queued: bool) -> int:
        self.waiting[key] = ticket
        return count_ahead(ticket, self.waiting.values()) + 1

    def heads(self, per_pool: int) -> set[tuple[str, str]]:
        by_pool: dict[str, list[tuple[tuple[int, str, str, str], tuple[str, str]]]] = {}
        for key, ticket in self.waiting.items():
            by_pool.setdefault(ticket.pool, []).append((ticket.order(), key))
        return {key for queue in by_pool.values() for _, key in sorted(queue)[:per_pool]}


def burst(n: int) -> list[Ticket]:
    rng = random.Random(SEED + n)
    return [
        Ticket(
            namespace=f"team-{i % 20:02d}",
            name=f"job-{i:05d}",
            priority=rng.choice((0, 0, 0, 10)),
            created=f"2026-11-25T10:{rng.randrange(60):02d}:{rng.randrange(60):02d}Z",
            pool=rng.choice(POOLS),
            nodes=1,
            gpus_per_node=rng.choice((1, 2, 4, 8)),
        )
        for i in range(n)
    ]


def timed_burst(
    tickets: list[Ticket],
    look: Callable[[Ticket, bool], int | None],
    heads: Callable[[int], set[tuple[str, str]]],
) -> tuple[float, list[int]]:
    """Seconds for the burst, and each job's position at its second look."""
    positions = []
    start = time.perf_counter()
    for round_, queued in enumerate([True, False]):
        for i, ticket in enumerate(tickets):
            position = look(ticket, queued)
            if round_ == 1:
                positions.append(position or 0)
            if i % HEADS_EVERY == 0:
                heads(PER_POOL)
    return time.perf_counter() - start, positions


def run_gpu_queue(tickets: list[Ticket]) -> tuple[float, list[int]]:
    queue = GpuQueue()

    def look(ticket: Ticket, queued: bool) -> int | None:
        queue.admit(ticket.key, ticket, [0], queued)
        return queue.position(ticket.key)

    return timed_burst(tickets, look, queue.heads)


def run_scan_queue(tickets: list[Ticket]) -> tuple[float, list[int]]:
    queue = ScanQueue()

    def look(ticket: Ticket, queued: bool) -> int | None:
        return queue.admit(ticket.key, ticket, [0], queued)

    return timed_burst(tickets, look, queue.heads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,5000,10000")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    rows = []
    for n in sizes:
        tickets = burst(n)
        sorted_s, sorted_positions = run_gpu_queue(tickets)
        scan_s, scan_positions = run_scan_queue(tickets)
        if sorted_positions != scan_positions:
            print(f"{n} jobs: the two queues gave different positions", file=sys.stderr)
            return 1
        questions = 2 * n + 2 * n // HEADS_EVERY
        rows.append((n, questions, sorted_s, scan_s))
        print(
            f"{n:>6} jobs, {questions} questions: sorted {sorted_s:.3f}s "
            f"({sorted_s / questions * 1e6:.1f} us each), scan {scan_s:.3f}s "
            f"({scan_s / questions * 1e6:.1f} us each)",
            flush=True,
        )

    lines = [
        f"# Queue speed — {dt.date.today().isoformat()}",
        "",
        "Made by `python benchmarks/queue_speed.py` (its docstring says what a burst is). "
        f"Python {platform.python_version()} on {os.cpu_count()} CPU(s), one thread. "
        "Growth: the time at this size over the time at the size before, against the jobs' "
        "ratio (linear) and its square.",
        "",
        "| jobs | questions | sorted (GpuQueue) s | µs per question | growth | "
        "scan (count_ahead) s | µs per question | growth |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    previous = None
    for n, questions, sorted_s, scan_s in rows:
        growth = ("", "")
        if previous is not None:
            pn, ps, pc = previous
            ratio = n / pn
            growth = (
                f"{sorted_s / ps:.1f}× (jobs {ratio:.0f}×, squared {ratio * ratio:.0f}×)",
                f"{scan_s / pc:.1f}×",
            )
        lines.append(
            f"| {n} | {questions} | {sorted_s:.3f} | {sorted_s / questions * 1e6:.1f} | "
            f"{growth[0]} | {scan_s:.3f} | {scan_s / questions * 1e6:.1f} | {growth[1]} |"
        )
        previous = (n, sorted_s, scan_s)
    table = "\n".join(lines) + "\n"
    print(table)
    if not args.no_write:
        out = args.out or HERE / "results" / f"queue-speed-{dt.date.today().isoformat()}.md"
        out.write_text(table)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
