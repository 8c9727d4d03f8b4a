"""One run: the cluster, the operator (or a floor in its stead), the creation burst, the
steady and background windows, and the record of what was measured."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import yaml

from benchmarks.measure import (
    Histograms,
    ProcSample,
    RequestKey,
    closed_between,
    counter_delta,
    cpu_split,
    load_average,
    machine_cpu,
    parse_closed_watchers,
    parse_histograms,
    percentile,
    proc_sample,
    running_apiservers,
    sched_autogroup,
)
from benchmarks.operator_scale.accounting import (
    QUIET_PER_S,
    Interval,
    OwnKey,
    batch_job_posts,
    breakdown,
    heartbeat_free,
    latency_summary,
    operator_view,
    own_delta,
    own_key_text,
    request_columns,
)
from benchmarks.operator_scale.api import Api, OwnRequests, Watch
from benchmarks.operator_scale.floor import PLANNED_FLOOR_WRITERS
from benchmarks.operator_scale.scenario import (
    ENDPOINT_CONTROLLERS_OFF,
    GROUP,
    LABEL_JOB,
    MODELS,
    POD_LOOPBACK_CIDR,
    VERSION,
    JobPlan,
    gpu_bin_packing,
    job_mix,
    planner_check,
    pool_docs,
    running_stages,
)
from benchmarks.operator_scale.tracker import (
    Snapshot,
    Tracker,
    after_delivery,
    first_seen,
    latencies,
    launch_latencies,
)


@dataclass
class Options:
    jobs: int
    clients: int
    namespaces: int
    nodes_per_pool: int
    steady_seconds: float
    background_seconds: float
    timeout: float
    settle_seconds: float
    progress_seconds: float
    label: str
    results: Path | None
    root: Path | None
    """The cluster's state folder; None: a new one, removed after a run that went well."""
    rescore: Path | None = None
    operator_env: dict[str, str] = field(default_factory=dict)
    apiserver_args: list[str] = field(default_factory=list)
    controller_manager_args: list[str] = field(default_factory=list)
    client_qps: int | None = None
    """kube-controller-manager's and kube-scheduler's client QPS and burst (None: theirs)."""
    bin_packing: bool = False
    without_operator: bool = False
    """Create the jobs with no operator running and measure only the API server's delivery
    of them to a watch (`Bench.delivery_only`)."""
    planned_floor: bool = False
    """With `without_operator`: the benchmark's minimal writer (`planned_floor_writer`)
    writes each job's Planned condition in the operator's stead."""
    floor_launches: int = 0
    """With `planned_floor`: how many jobs the minimal writer also launches (a batch Job of
    one pod each), for the floor under creation → first pod."""
    floor_writers: int = PLANNED_FLOOR_WRITERS
    """With `planned_floor`: the minimal writer's threads."""


def say(msg: str) -> None:
    print(msg, flush=True)


def operator_source(env: Mapping[str, str]) -> tuple[str, str]:
    """Where the operator process imports `kubetune` from, and the last commit that changed
    that package (`+dirty` when it has uncommitted changes): the operator's version, whatever
    else the checkout's later commits touched."""
    out = subprocess.run(
        [sys.executable, "-c", "import kubetune; print(kubetune.__file__)"],
        env=dict(env),
        capture_output=True,
        text=True,
        check=True,
    )
    package = Path(out.stdout.strip()).parent
    git = ["git", "-C", str(package)]
    last = subprocess.run(
        [*git, "log", "-1", "--format=%h", "--", "."], capture_output=True, text=True
    )
    if last.returncode != 0 or not last.stdout.strip():
        return str(package), "(not a git checkout)"
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "."], capture_output=True, text=True
    )
    return str(package), last.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def wait(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.5) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def create_all(api: Api, jobs: Sequence[JobPlan], clients: int) -> tuple[float, Counter[str]]:
    """POST every job from `clients` threads at once; the wall time and the outcomes."""
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def create(job: JobPlan) -> None:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{job.namespace}/finetunejobs"
        body = json.dumps(job.doc()).encode()
        outcome = "error"
        for attempt in range(6):
            status, data = api.request("POST", path, ("POST", "finetunejobs", ""), body=body)
            if status in (201, 409):
                outcome = str(status)
                break
            if status not in (429, 500, 503, 504):
                outcome = f"HTTP {status}: {data[:200].decode(errors='replace')}"
                break
            time.sleep(0.2 * 2**attempt)
        with lock:
            outcomes[outcome] += 1

    t0 = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=clients, thread_name_prefix="client")
    try:
        list(pool.map(create, jobs))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return time.monotonic() - t0, outcomes


class Mark(NamedTuple):
    """A point in the run: the API server's request counters, the benchmark's own requests,
    the time and the operator's CPU and memory."""

    totals: dict[RequestKey, float]
    own: Counter[OwnKey]
    when: float
    proc: ProcSample | None


def interval(start: Mark, end: Mark) -> Interval:
    return Interval(
        delta=counter_delta(end.totals, start.totals),
        own=own_delta(end.own, start.own),
        seconds=end.when - start.when,
    )


class Bench:
    """One run: the cluster, the operator, the jobs and what is measured."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.own = OwnRequests()
        self.tracker = Tracker()
        self.watches: list[Watch] = []
        self.pools = pool_docs(opts.nodes_per_pool)
        self.jobs: list[JobPlan] = []
        self.marks: dict[str, Mark] = {}
        self.histograms: dict[str, Histograms] = {}
        self.closed_watchers: dict[str, dict[str, float]] = {}
        self.other_apiservers = running_apiservers()
        self.facts: dict[str, Any] = {
            "load_start": load_average(),
            "other_apiservers": len(self.other_apiservers),
        }
        self.metrics_port = 0
        self.first_events: subprocess.Popen[bytes] | None = None
        self.writer: subprocess.Popen[bytes] | None = None
        self.first_events_file: Path | None = None

    # ------------------------------------------------------------------ the whole run

    def run(self) -> dict[str, Any]:
        from kubetune_dev.binaries import ensure_binaries
        from kubetune_dev.cluster import LocalCluster, default_root

        self.jobs = self.plan_jobs()
        if self.other_apiservers:
            say(
                f"warning: {len(self.other_apiservers)} other kube-apiserver(s) running "
                f"(pids {self.other_apiservers}): they share the cores, and the row says so; "
                "stop them first for comparable numbers (`kubetune dev down --root DIR`)"
            )
        binaries = ensure_binaries(say)
        root = self.opts.root
        if root is None:  # a folder of its own: runs by others on this machine keep theirs
            parent = default_root("operator-scale").parent
            parent.mkdir(parents=True, exist_ok=True)
            root = Path(tempfile.mkdtemp(prefix="operator-scale-", dir=parent))
        done = False
        with tempfile.TemporaryDirectory(prefix="kubetune-operator-scale-") as work:
            stages = Path(work) / "kwok-stages-running.yaml"
            stages.write_text(running_stages(binaries.kwok_stages.read_text()))
            self.cluster = LocalCluster(
                root,
                binaries,
                say,
                kwok_stages=stages,
                kwok_args=[f"--cidr={POD_LOOPBACK_CIDR}"],
                apiserver_args=self.opts.apiserver_args,
                controller_manager_args=[
                    ENDPOINT_CONTROLLERS_OFF,
                    *self.control_plane_args(),
                    *self.opts.controller_manager_args,
                ],
                scheduler_config=self.scheduler_config(),
                die_with_caller=True,  # a run killed outright leaves no control plane behind
            )
            try:
                self.prepare()
                if not self.opts.without_operator:
                    self.start_operator()
                self.start_watches()
                if self.opts.planned_floor:
                    self.start_writer(Path(work) / "writer-ready")
                self.start_first_events(Path(work) / "first-events.jsonl")
                self.create_and_settle()
                if not self.opts.without_operator:
                    self.steady_window()
                    self.background_window()
                done = True
            finally:
                for w in self.watches:
                    w.stop()
                for process in (self.first_events, self.writer):
                    if process is not None:
                        process.kill()
                        process.wait()
                left = self.cluster.stop()
                say(f"WARNING: processes survived: {left}" if left else "cluster stopped")
                if done and not left and self.opts.root is None:
                    shutil.rmtree(root, ignore_errors=True)
                else:
                    say(f"component logs: {root / 'logs'}")
        return self.delivery_summary() if self.opts.without_operator else self.summary()

    def plan_jobs(self) -> list[JobPlan]:
        t0 = time.monotonic()
        jobs = job_mix(self.opts.jobs, self.opts.namespaces, planner_check(self.pools))
        if len({job.question() for job in jobs}) != len(jobs):
            raise AssertionError("two jobs ask the planner the same question")
        say(
            f"job mix: {len(jobs)} jobs, {len(MODELS)} models, methods "
            f"{dict(Counter(j.method for j in jobs))}, GPUs "
            f"{dict(Counter(j.gpus for j in jobs))} (each checked with the planner: "
            f"{time.monotonic() - t0:.1f}s)"
        )
        return jobs

    def snapshot(self) -> Snapshot:
        return self.tracker.snapshot(time.time(), self.patience)

    @property
    def patience(self) -> float:
        """How long a trainer pod may stay Pending before the operator gives up moving it:
        its reschedule delay, two polls for noticing, and a margin."""
        from kubetune.control.reconcile import ControllerSettings  # the operator benchmarked

        env = self.opts.operator_env
        reschedule = float(
            env.get("KUBETUNE_RESCHEDULE_SECONDS") or ControllerSettings.reschedule_seconds
        )
        poll = float(env.get("KUBETUNE_POLL_SECONDS") or ControllerSettings.poll_seconds)
        return reschedule + 2 * poll + 15

    def cpu_sample(self) -> dict[str, float]:
        """CPU seconds so far of every process of the run by name: the control plane's
        components and the operator, this benchmark (its creating clients and watches), the
        independent watch, the minimal writer, and the whole machine (`machine busy`)."""
        pids = dict(self.cluster.state.pids)
        pids["benchmark"] = os.getpid()
        if self.first_events is not None:
            pids["independent watch"] = self.first_events.pid
        if self.writer is not None:
            pids["minimal writer"] = self.writer.pid
        out: dict[str, float] = {}
        for name, pid in pids.items():
            try:
                out[name] = proc_sample(pid).cpu_s
            except (OSError, ValueError):  # gone: left out of the split
                continue
        out["machine busy"] = machine_cpu()[0]
        return out

    def mark(self, name: str) -> Mark:
        text = self.api.metrics_text()
        totals = self.api.request_totals(text)
        self.histograms[name] = parse_histograms(text)
        self.closed_watchers[name] = parse_closed_watchers(text)
        pid = self.cluster.state.pids.get("operator")
        proc = proc_sample(pid) if pid is not None else None
        self.marks[name] = Mark(totals, self.own.snapshot(), time.monotonic(), proc)
        return self.marks[name]

    # ------------------------------------------------------------------ steps

    def prepare(self) -> None:
        from kubetune.api.crdgen import render_all

        cluster = self.cluster
        cluster.start()
        cluster.apply([yaml.safe_load(text) for text in render_all().values()])
        cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=30s")
        cluster.add_simulated_pools(self.pools)
        namespaces = sorted({job.namespace for job in self.jobs})
        cluster.apply(
            [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in namespaces]
        )
        self.api = api = Api(cluster.kubeconfig, self.own)
        total_nodes = self.opts.nodes_per_pool * len(self.pools)

        def nodes_ready() -> bool:
            items = api.get_json("/api/v1/nodes", ("LIST", "nodes", ""))["items"]
            return sum(1 for n in items if _ready(n)) >= total_nodes

        def service_accounts() -> bool:
            path = "/api/v1/serviceaccounts?fieldSelector=metadata.name%3Ddefault"
            items = api.get_json(path, ("LIST", "serviceaccounts", ""))["items"]
            return set(namespaces) <= {i["metadata"]["namespace"] for i in items}

        wait(f"{total_nodes} kwok nodes to be Ready", nodes_ready, 180, 1.0)
        wait("default ServiceAccounts in every namespace", service_accounts, 60, 0.5)
        self.wait_quiet()

    def wait_quiet(self, every: float = 5.0, timeout: float = 180.0) -> None:
        """Wait until the new nodes are digested: for about a minute the controllers GET,
        PATCH and post Events for every node (TTL annotations, node lifecycle), which would
        land in the measurement."""
        t0 = time.monotonic()
        last = Mark(self.api.request_totals(), self.own.snapshot(), t0, None)
        calm = 0
        while time.monotonic() - t0 < timeout:
            time.sleep(every)
            now = Mark(self.api.request_totals(), self.own.snapshot(), time.monotonic(), None)
            rate = interval(last, now).rate(heartbeat_free)
            last = now
            calm = calm + 1 if rate < QUIET_PER_S else 0
            if calm >= 2:
                say(f"cluster quiet after {time.monotonic() - t0:.0f}s ({rate:.1f} req/s)")
                return
        say(f"WARNING: the cluster was still busy after {timeout:.0f}s; measuring anyway")

    def control_plane_args(self) -> list[str]:
        qps = self.opts.client_qps
        return [] if qps is None else [f"--kube-api-qps={qps}", f"--kube-api-burst={qps}"]

    def scheduler_config(self) -> dict[str, Any] | None:
        if self.opts.client_qps is None and not self.opts.bin_packing:
            return None
        config = gpu_bin_packing() if self.opts.bin_packing else {}
        if self.opts.client_qps is not None:
            config["clientConnection"] = {
                "qps": self.opts.client_qps,
                "burst": self.opts.client_qps,
            }
        return config

    def start_operator(self) -> None:
        env = self.cluster.env()
        env.update(self.opts.operator_env)
        source, commit = operator_source(env)
        self.facts.update(operator_source=source, commit=commit)
        say(f"operator: kubetune from {source} at {commit}")
        from kubetune_dev.cluster import free_port

        # Its /metrics on a free port (read at the end of the steady window), unless set.
        settings = {"KUBETUNE_METRICS_PORT": str(free_port()), **self.opts.operator_env}
        self.metrics_port = int(settings["KUBETUNE_METRICS_PORT"])
        self.pid = self.cluster.start_operator(settings)

        def pools_seen() -> bool:
            self.cluster.check_alive()
            path = f"/apis/{GROUP}/{VERSION}/gpupools"
            items = self.api.get_json(path, ("LIST", "gpupools", ""))["items"]
            return all(
                (p.get("status") or {}).get("nodes") == self.opts.nodes_per_pool for p in items
            )

        wait("the operator to report every GPUPool's nodes", pools_seen, 120, 1.0)

    def spawn_helper(self, flag: str, out: Path, *more: str) -> subprocess.Popen[bytes]:
        """This benchmark as a process of its own (`cli.main`'s `flag`), given the
        kubeconfig, `out`, a file it writes a first line to once its watch of FineTuneJobs
        has listed, and `more`. It finds the `benchmarks` package as this process did: in
        the working folder, or on the PYTHONPATH, both of which it inherits."""
        argv = [sys.executable, "-m", "benchmarks.operator_scale", flag]
        argv += [str(self.cluster.kubeconfig), str(out), *more]
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL)

    @staticmethod
    def wait_listed(process: subprocess.Popen[bytes], out: Path, what: str) -> None:
        def listed() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited ({process.returncode})")
            return out.exists() and bool(out.read_text().strip())

        wait(f"{what} to list FineTuneJobs", listed, 60, 0.5)

    def start_first_events(self, out: Path) -> None:
        """A watch of FineTuneJobs in a process of its own (`first_events`), started before
        the creation burst."""
        self.first_events = self.spawn_helper("--first-events", out)
        self.first_events_file = out
        self.wait_listed(self.first_events, out, "the independent watch")

    def start_writer(self, ready: Path) -> None:
        """`--planned-floor`: the minimal writer (`planned_floor_writer`) in a process of
        its own, started before the creation burst."""
        launches, threads = str(self.opts.floor_launches), str(self.opts.floor_writers)
        self.writer = self.spawn_helper("--planned-floor-writer", ready, launches, threads)
        self.wait_listed(self.writer, ready, "the minimal writer")

    def start_watches(self) -> None:
        self.watches = [
            Watch(
                self.api,
                f"/apis/{GROUP}/{VERSION}/finetunejobs",
                "finetunejobs",
                self.tracker.on_job,
            ),
            Watch(
                self.api,
                f"/api/v1/pods?labelSelector={quote(LABEL_JOB)}",
                "pods",
                self.tracker.on_pod,
            ),
            Watch(
                self.api,
                f"/apis/batch/v1/jobs?labelSelector={quote(LABEL_JOB)}",
                "jobs",
                self.tracker.on_batch_job,
            ),
        ]
        for w in self.watches:
            w.start()
        for w in self.watches:
            if not w.synced.wait(30):
                raise TimeoutError(f"the {w.resource} watch did not start")

    def create_and_settle(self) -> None:
        opts, n = self.opts, len(self.jobs)
        start = self.mark("start")
        cpu_start = self.cpu_sample()
        say(f"creating {n} FineTuneJobs from {opts.clients} clients ...")
        create_s, outcomes = create_all(self.api, self.jobs, opts.clients)
        self.facts.update(
            create_s=round(create_s, 2),
            create_outcomes=dict(outcomes),
            cpu_s_creation=cpu_split(cpu_start, self.cpu_sample(), create_s),
        )
        say(f"created in {create_s:.1f}s: {dict(outcomes)}")
        say(f"CPU seconds while creating: {self.facts['cpu_s_creation']}")
        if opts.without_operator:
            self.delivery_only(start, cpu_start)
            return
        signature: tuple[Any, ...] = ()
        last_change = next_print = 0.0
        steady = False
        while time.monotonic() - start.when < opts.timeout:
            self.cluster.check_alive()
            snap = self.snapshot()
            now = time.monotonic()
            if snap.signature() != signature:
                signature, last_change = snap.signature(), now
            if now >= next_print:
                say(
                    f"[{now - start.when:5.0f}s] planned {snap.planned}/{n} | "
                    + " ".join(f"{k} {v}" for k, v in sorted(snap.phases.items()))
                    + f" | pods running {snap.running_pods} pending {snap.pending_pods}"
                    + f" (young {snap.young_pending_pods}, volumes {snap.volume_pending_pods})"
                    + f" | load {load_average()}"
                )
                next_print = now + opts.progress_seconds
            if snap.settled(n) and now - last_change >= opts.settle_seconds:
                steady = True
                break
            time.sleep(0.5)
        # Planned-ness is judged here, at steady state or at the timeout.
        self.facts.update(steady=steady, not_planned_reasons=dict(snap.not_planned_reasons))
        self.timings = self.tracker.timings()
        if self.first_events_file is not None:
            seen_first = first_seen(self.first_events_file)
            delivered = latencies(self.timings[0], seen_first)
            self.facts.update(
                delivered_n=len(delivered),
                delivered_p50_s=percentile(delivered, 50) if delivered else None,
                delivered_p99_s=percentile(delivered, 99) if delivered else None,
                **after_delivery(seen_first, self.timings.planned),
            )
        took = time.monotonic() - start.when
        self.facts["cpu_s_to_steady_by_process"] = cpu_split(cpu_start, self.cpu_sample(), took)
        if steady:
            say(f"steady after {took:.0f}s (nothing changed for {opts.settle_seconds:.0f}s)")
        else:
            say(f"NOT steady within --timeout {opts.timeout:.0f}s; measuring the window anyway")

    def delivery_only(self, start: Mark, cpu_start: Mapping[str, float]) -> None:
        """`--without-operator`: wait until the independent watch has seen every job, then
        record how late it saw them and what each process spent meanwhile. Nothing else
        happens to the jobs (no operator), so this is the API server's delivery under the
        creation burst alone: the floor under the operator's creation → Planned.

        With `--planned-floor` it also waits until the benchmark's watch has seen every
        job's Planned condition from the minimal writer, and records how late it was
        decided (when the writer's watch showed the job), written and seen; with
        `--floor-launches N`, until the first pod of each of the N jobs it launched is
        there, and how late the batch Jobs and the pods came."""
        events = self.first_events_file
        assert events is not None
        n, launches = len(self.jobs), self.opts.floor_launches

        def all_seen() -> bool:
            if self.writer is not None and self.snapshot().planned < n:
                return False
            if len(self.tracker.timings().first_pod) < launches:
                return False
            return len(first_seen(events)) >= n

        what = "see all" if self.writer is None else "see all, and the writer to plan all,"
        if launches:
            what = f"see all, the writer to plan all and to launch {launches},"
        wait(f"the independent watch to {what} {n} jobs", all_seen, self.opts.timeout, 0.5)
        took = time.monotonic() - start.when
        self.mark("seen")
        self.timings = self.tracker.timings()
        delivered = latencies(self.timings[0], first_seen(events))
        self.facts.update(
            delivered_n=len(delivered),
            delivered_p50_s=percentile(delivered, 50),
            delivered_p99_s=percentile(delivered, 99),
            delivered_max_s=max(delivered),
            all_seen_s=round(took, 1),
            cpu_s_to_all_seen=cpu_split(cpu_start, self.cpu_sample(), took),
        )
        if self.writer is not None:  # under the keys of an operator run's record
            created, planned = self.timings.created, self.timings.planned
            for key, at in (
                ("plan", planned),
                ("plan_written", self.timings.planned_written),
                ("plan_seen", self.timings.planned_seen),
            ):
                lat = latencies(created, at)
                self.facts[f"{key}_p50_s"] = percentile(lat, 50)
                self.facts[f"{key}_p99_s"] = percentile(lat, 99)
            self.facts["plan_max_s"] = max(latencies(created, planned))
        if launches:
            self.facts.update(launched=launches, **launch_latencies(self.timings))

    def steady_window(self) -> None:
        before = self.snapshot()
        changes = self.tracker.phase_changes
        start = self.mark("steady")
        since_phase_change = start.when - self.tracker.last_phase_change
        assert start.proc is not None
        peak = start.proc.rss_kib
        say(f"steady window: {self.opts.steady_seconds:.0f}s ...")
        self.tracker.steady_seen = self.tracker.counting_writes = True
        while time.monotonic() - start.when < self.opts.steady_seconds:
            time.sleep(1.0)
            self.cluster.check_alive()
            peak = max(peak, proc_sample(self.pid).rss_kib)
        end = self.mark("steady_end")
        self.tracker.counting_writes = False
        assert end.proc is not None
        after = self.snapshot()
        self.facts["operator_view"] = self.operator_metrics()
        self.facts.update(
            phases=dict(before.phases),
            running_jobs=(before.phases["Running"] + after.phases["Running"]) / 2,
            running_pods=before.running_pods,
            pending_pods=before.pending_pods,
            volume_pending_pods=before.volume_pending_pods,
            pending_reasons=dict(before.pending_reasons.most_common(5)),
            window_phase_changes=self.tracker.phase_changes - changes,
            window_status_changes=dict(self.tracker.writes.most_common(8)),
            burst_status_changes=dict(self.tracker.burst_writes.most_common(10)),
            window_position_moves=dict(self.tracker.moves),
            window_after_phase_change_s=round(since_phase_change, 1),
            rss_peak_mib=max(peak, end.proc.rss_kib) / 1024,
            rss_hwm_mib=end.proc.hwm_kib / 1024,
            pools_chosen=self.tracker.pools(),
        )

    def operator_metrics(self) -> dict[str, dict[str, Any]]:
        """The operator's own split of creation → Planned (`operator_view`); empty when its
        /metrics cannot be read (said, not fatal: the API server's numbers stand alone)."""
        if self.metrics_port <= 0:
            return {}
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return operator_view(resp.read().decode())
        except OSError as exc:
            say(f"the operator's /metrics ({url}) could not be read: {exc}")
            return {}

    def background_window(self) -> None:
        """The same cluster without the operator: what the other components do anyway."""
        say(f"background window without the operator: {self.opts.background_seconds:.0f}s ...")
        self.cluster.stop_component("operator")
        time.sleep(3.0)  # the operator's watches end; the API server counts them then
        start = self.mark("background")
        while time.monotonic() - start.when < self.opts.background_seconds:
            time.sleep(1.0)
        self.mark("background_end")
        self.facts["watch_errors"] = sum(w.errors for w in self.watches)

    # ------------------------------------------------------------------ results

    def setup_record(self) -> dict[str, Any]:
        """When the run ended and how it was set up: the head of every record."""
        opts = self.opts
        return {
            "date": dt.date.today().isoformat(),
            "time": dt.datetime.now().strftime("%H:%M"),
            "label": opts.label,
            "jobs": len(self.jobs),
            "clients": opts.clients,
            "namespaces": opts.namespaces,
            "pools": f"{len(self.pools)}×{opts.nodes_per_pool}×8",
            "apiserver_args": opts.apiserver_args,
            "controller_manager_args": opts.controller_manager_args,
            "client_qps": opts.client_qps,
            "bin_packing": opts.bin_packing,
            "sched_autogroup": sched_autogroup(),
        }

    def delivery_summary(self) -> dict[str, Any]:
        """The record of a `--without-operator` (or `--planned-floor`) run."""
        m = self.marks
        seen = interval(m["start"], m["seen"])
        return {
            **self.setup_record(),
            "mode": "planned floor" if self.opts.planned_floor else "without operator",
            **({"floor_writers": self.opts.floor_writers} if self.opts.planned_floor else {}),
            "commit": operator_source(self.cluster.env())[1],
            **self.facts,
            "load_end": load_average(),
            "latency_create_to_seen": latency_summary(
                self.histograms["start"], self.histograms["seen"]
            ),
            "requests_create_to_seen": breakdown(seen.delta),
            "watches_closed_create_to_seen": closed_between(
                self.closed_watchers["start"], self.closed_watchers["seen"]
            ),
        }

    def summary(self) -> dict[str, Any]:
        opts, m, n = self.opts, self.marks, len(self.jobs)
        created, planned, _, first_pod, queued, planned_seen, written = self.timings
        seen_lat = latencies(created, planned_seen)
        written_lat = latencies(created, written)
        plan_lat, pod_lat = latencies(created, planned), latencies(created, first_pod)
        at_once = {k: v for k, v in first_pod.items() if k not in queued}
        pod_at_once = latencies(created, at_once)
        span = (max(planned.values()) - min(created.values())) if planned else math.nan
        create = interval(m["start"], m["steady"])
        window = interval(m["steady"], m["steady_end"])
        background = interval(m["background"], m["background_end"])
        cpu0, cpu1, cpu2 = (m[k].proc for k in ("start", "steady", "steady_end"))
        assert cpu0 is not None and cpu1 is not None and cpu2 is not None

        whole = counter_delta(m["steady_end"].totals, m["start"].totals)
        record: dict[str, Any] = {
            **self.setup_record(),
            "operator_env": opts.operator_env,
            **self.facts,
            "planned": len(planned),
            "not_planned": n - len(planned),
            "plan_p50_s": percentile(plan_lat, 50),
            "plan_p99_s": percentile(plan_lat, 99),
            "plan_max_s": max(plan_lat, default=math.nan),
            "plan_seen_p50_s": percentile(seen_lat, 50),
            "plan_seen_p99_s": percentile(seen_lat, 99),
            "plan_written_p50_s": percentile(written_lat, 50),
            "plan_written_p99_s": percentile(written_lat, 99),
            **launch_latencies(self.timings),
            "jobs_with_pods": len(pod_lat),
            "pod_at_once_p50_s": percentile(pod_at_once, 50),
            "pod_at_once_p99_s": percentile(pod_at_once, 99),
            "jobs_launched_at_once": len(pod_at_once),
            "first_queued": self.tracker.first_queued(),
            "planned_per_s": len(planned) / max(span, 1.0) if planned else 0.0,
            "to_steady_s": round(create.seconds, 1),
            "window_s": round(window.seconds, 1),
            "background_s": round(background.seconds, 1),
            "cpu_pct": 100 * (cpu2.cpu_s - cpu1.cpu_s) / window.seconds,
            "cpu_s_to_steady": cpu1.cpu_s - cpu0.cpu_s,
            "job_post_201": batch_job_posts(whole, "201"),
            "job_post_409": batch_job_posts(whole, "409"),
            "load_end": load_average(),
            "latency_create_to_steady": latency_summary(
                self.histograms["start"], self.histograms["steady"]
            ),
            "requests_create_to_steady": breakdown(create.delta),
            "watches_closed_create_to_steady": closed_between(
                self.closed_watchers["start"], self.closed_watchers["steady"]
            ),
            "requests_steady_window": breakdown(window.delta),
            "requests_background_window": breakdown(background.delta),
            "own_requests": {
                name: {own_key_text(k): n for k, n in part.own.items()}
                for name, part in (
                    ("create_to_steady", create),
                    ("steady_window", window),
                    ("background_window", background),
                )
            },
        }
        record.update(request_columns(record))
        return record


def _ready(node: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (node.get("status") or {}).get("conditions") or []
    )


def run(opts: Options) -> dict[str, Any]:
    return Bench(opts).run()
