"""The command line: `python -m benchmarks.operator_scale [options]` (the package's
docstring says what a run does), and the helper processes a run starts of itself."""

from __future__ import annotations

import argparse
import datetime as dt
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import benchmarks.operator_scale as _package
from benchmarks.operator_scale.bench import Options, run, say
from benchmarks.operator_scale.floor import (
    PLANNED_FLOOR_WRITERS,
    first_events,
    planned_floor_writer,
)
from benchmarks.operator_scale.report import (
    delivery_report,
    report,
    rescore,
    table_row,
    write_delivery_results,
    write_results,
)
from benchmarks.operator_scale.scenario import OPERATOR_DEFAULTS, SCALE_TEST_QPS

RESULTS = Path(__file__).resolve().parents[1] / "results"


def parse_args(argv: Sequence[str] | None = None) -> Options:
    from kubetune_dev.cluster import default_root

    p = argparse.ArgumentParser(
        description=_package.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--jobs", type=int, help="FineTuneJobs to create (1000; --quick: 50)")
    p.add_argument("--clients", type=int, default=32, help="concurrent creating clients (32)")
    p.add_argument("--namespaces", type=int, default=20, help="namespaces the jobs go to (20)")
    p.add_argument("--nodes-per-pool", type=int, default=50, help="kwok nodes per pool (50)")
    p.add_argument("--steady-seconds", type=float, help="steady window (60; --quick: 20)")
    p.add_argument(
        "--background-seconds",
        type=float,
        help="window without the operator, for the cluster's background requests (30; --quick: 10)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        help="seconds after the first create to reach Planned and steady state (900; --quick: 300)",
    )
    p.add_argument(
        "--settle-seconds",
        type=float,
        help="steady means nothing changed this long (30; --quick: 10)",
    )
    p.add_argument("--progress-seconds", type=float, default=5.0, help="progress every (5)")
    p.add_argument("--label", default="", help="label of the results row")
    p.add_argument(
        "--results",
        type=Path,
        help="results table to append to (benchmarks/results/operator-scale-<date>.md; "
        "--quick writes none unless given)",
    )
    p.add_argument(
        "--operator-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment of the operator process, e.g. KUBETUNE_POLL_SECONDS=5 (repeatable; "
        "over OPERATOR_DEFAULTS: no hub stage-in, ReadWriteMany checkpoint volumes)",
    )
    p.add_argument(
        "--apiserver-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra kube-apiserver flag, e.g. --max-requests-inflight=800 (repeatable)",
    )
    p.add_argument(
        "--controller-manager-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra kube-controller-manager flag, e.g. --kube-api-qps=100 (repeatable)",
    )
    p.add_argument(
        "--client-qps",
        type=int,
        metavar="N",
        help=f"kube-controller-manager's and kube-scheduler's client QPS and burst "
        f"(default: theirs, 20/30 and 50/100; Kubernetes' scalability tests use "
        f"{SCALE_TEST_QPS})",
    )
    p.add_argument(
        "--bin-packing",
        action="store_true",
        help="kube-scheduler fills the busiest node's GPUs first (MostAllocated on "
        "nvidia.com/gpu), as docs/operations.md recommends for GPU pools",
    )
    p.add_argument(
        "--without-operator",
        action="store_true",
        help="no operator: create the jobs and measure only how soon the API server delivers "
        "them to a watch, and each process's CPU meanwhile (a row of "
        "apiserver-delivery-<date>.md instead)",
    )
    p.add_argument(
        "--planned-floor",
        action="store_true",
        help="no operator: a minimal writer of the benchmark's own writes each job's Planned "
        "condition as soon as its watch shows the job (one status write per job, nothing "
        "else), the floor under the operator's creation → Planned (a row of "
        "planned-floor-<date>.md)",
    )
    p.add_argument(
        "--floor-launches",
        type=int,
        default=0,
        metavar="N",
        help="with --planned-floor: the minimal writer also launches the first N jobs it "
        "sees, one batch Job of one 1-GPU pod each, the floor under creation → first pod "
        "(default 0)",
    )
    p.add_argument(
        "--floor-writers",
        type=int,
        default=PLANNED_FLOOR_WRITERS,
        metavar="N",
        help="with --planned-floor: the minimal writer's threads, each with a connection of "
        f"its own (default {PLANNED_FLOOR_WRITERS})",
    )
    p.add_argument(
        "--root",
        type=Path,
        help="cluster state folder, kept (default: a new folder under "
        f"{default_root('operator-scale').parent}, removed after a run that went well)",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 50 jobs, short windows")
    p.add_argument(
        "--rescore",
        type=Path,
        metavar="JSONL",
        help="run nothing: derive the request columns of the runs in a results .jsonl again "
        "from their stored counts, and rewrite it and the table of the .md beside it",
    )
    a = p.parse_args(argv)
    quick = bool(a.quick)
    env = dict(OPERATOR_DEFAULTS)
    for item in a.operator_env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            p.error(f"--operator-env {item!r}: expected NAME=VALUE")
        env[name] = value
    jobs = a.jobs if a.jobs is not None else (50 if quick else 1000)
    if jobs < 1 or a.clients < 1 or a.namespaces < 1 or a.nodes_per_pool < 1:
        p.error("--jobs, --clients, --namespaces and --nodes-per-pool must be at least 1")
    if a.floor_writers < 1:
        p.error("--floor-writers must be at least 1")
    if a.floor_launches and not a.planned_floor:
        p.error("--floor-launches needs --planned-floor (the minimal writer launches them)")
    if not 0 <= a.floor_launches <= jobs:
        p.error(f"--floor-launches must be between 0 and --jobs ({jobs})")
    results = a.results
    if results is None and not quick:
        stem = (
            "planned-floor"
            if a.planned_floor
            else "apiserver-delivery"
            if a.without_operator
            else "operator-scale"
        )
        results = RESULTS / f"{stem}-{dt.date.today().isoformat()}.md"
    return Options(
        jobs=jobs,
        clients=a.clients,
        namespaces=a.namespaces,
        nodes_per_pool=a.nodes_per_pool,
        steady_seconds=a.steady_seconds or (20.0 if quick else 60.0),
        background_seconds=a.background_seconds or (10.0 if quick else 30.0),
        timeout=a.timeout or (300.0 if quick else 900.0),
        settle_seconds=a.settle_seconds or (10.0 if quick else 30.0),
        progress_seconds=a.progress_seconds,
        label=a.label or ("quick" if quick else ""),
        results=results,
        root=a.root,
        operator_env=env,
        apiserver_args=list(a.apiserver_arg),
        controller_manager_args=list(a.controller_manager_arg),
        client_qps=a.client_qps,
        bin_packing=a.bin_packing,
        without_operator=a.without_operator or a.planned_floor,
        planned_floor=a.planned_floor,
        floor_launches=a.floor_launches,
        floor_writers=a.floor_writers,
        rescore=a.rescore,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--first-events"] and len(args) == 3:  # the independent watch's process
        first_events(Path(args[1]), Path(args[2]))
        return 0
    if args[:1] == ["--planned-floor-writer"] and len(args) == 5:  # the minimal writer
        planned_floor_writer(Path(args[1]), Path(args[2]), int(args[3]), int(args[4]))
        return 0
    opts = parse_args(argv)
    if opts.rescore is not None:
        for record in rescore(opts.rescore):
            say(table_row(record).rstrip())
        say(f"rewrote {opts.rescore} and the table of {opts.rescore.with_suffix('.md')}")
        return 0

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    from kubetune_dev.cluster import ClusterError

    try:
        result = run(opts)
    except KeyboardInterrupt:
        say("interrupted; the cluster was stopped")
        return 130
    except (ClusterError, TimeoutError) as exc:
        say(f"failed: {exc}")
        return 1
    if opts.without_operator:
        say(delivery_report(result))
        if opts.results is not None:
            write_delivery_results(opts.results, result)
            say(f"appended to {opts.results} (details: {opts.results.with_suffix('.jsonl')})")
        return 0
    say(report(result))
    if opts.results is not None:
        write_results(opts.results, result)
        say(f"appended to {opts.results} (details: {opts.results.with_suffix('.jsonl')})")
    return 0
