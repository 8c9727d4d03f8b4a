"""The operator at scale: many FineTuneJobs at once on the local control plane with kwok.

Starts the local control plane (docs/local-cluster.md) with four simulated GPU pools of the
built-in catalog (rtx4090-spot, l40s, a100-80gb, h100; `--nodes-per-pool` kwok nodes of 8 GPUs
each), `--namespaces` namespaces and the operator as its own process
(`LocalCluster.start_operator`: `python -m kopf run -m kubetune.controller.handlers`, whatever
`kubetune` the interpreter imports). Then `--clients` threads create `--jobs` FineTuneJobs at
once over HTTPS with the kubeconfig's client certificate, every one a different question for
the planner (model, method, sequence length, dataset size, GPU count), and the benchmark waits
until every job that can run is Running with its trainer pods Running, measures a steady-state
window of `--steady-seconds`, and stops the cluster (also on Ctrl-C).

kwok runs its release's "fast" stages without `pod-complete`, so trainer pods stay Running
instead of completing at once, and it gives pods loopback addresses (`--cidr`), so the
operator's scrapes of the trainers' metrics are refused at once instead of leaving the machine.

What it prints, and appends as a row to benchmarks/results/operator-scale-<date>.md (with
every detail, the API request breakdown included, as a JSON line in the .jsonl beside it);
docs/local-cluster.md#the-operator-at-scale says what each column means:

- creation → Planned condition p50/p99 (`lastTransitionTime` − `creationTimestamp`, both the
  API server's clock, 1 s resolution), creation → first trainer pod p50/p99 (the first pod
  labelled `kubetune.io/job=<job>`), jobs/s reaching Planned, jobs never Planned in --timeout;
- the operator's peak RSS and CPU (% of one core) over the steady window, from /proc;
- API requests from the API server's own `apiserver_request_total`, which has no user label:
  every client's requests are in it. The benchmark subtracts its own, those that are never the
  operator's (`never_the_operators`: the local provisioner's, the scheduler's Events) and the
  cluster's background rate, measured in a window of `--background-seconds` after the
  operator is stopped (`beyond_background`).

Usage:
    python benchmarks/operator_scale.py --jobs 500 --label before
    python benchmarks/operator_scale.py --quick          # 50 jobs, short windows, no results row
    python benchmarks/operator_scale.py --planned-floor  # no operator: the least one can do
    python benchmarks/operator_scale.py --planned-floor --floor-launches 250  # ... and launch
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import math
import os
import queue
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple, TypeVar
from urllib.parse import quote, urlsplit

import yaml

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

GROUP, VERSION = "kubetune.io", "v1alpha1"
LABEL_JOB = "kubetune.io/job"
POD_LOOPBACK_CIDR = "127.16.0.0/12"
"""kwok's pod addresses: on loopback, where nothing listens on the trainers' metrics port."""
DROPPED_STAGES = frozenset({"pod-complete"})
"""kwok stages left out, so that trainer pods stay Running."""
ENDPOINT_CONTROLLERS_OFF = (
    "--controllers=-endpoints-controller,-endpointslice-controller,"
    "-endpointslice-mirroring-controller"
)
"""Endpoints of the trainers' headless Services: no use without DNS or kube-proxy, and the
controllers would retry loopback pod addresses (which Endpoints refuse) forever."""
SCALE_TEST_QPS = 100
"""The client rate limit (QPS and burst) Kubernetes' own 5,000-node scalability tests give
kube-controller-manager and kube-scheduler; their defaults are 20/30 and 50/100."""


def gpu_bin_packing() -> dict[str, Any]:
    """A kube-scheduler profile that fills the busiest node's GPUs first (MostAllocated on
    nvidia.com/gpu, no balancing of CPU and memory): what the operator's queue assumes when
    it reserves GPUs (best fit), and what keeps whole nodes free for multi-GPU jobs. The
    default profile spreads pods, so one-GPU pods fragment the nodes."""
    return {
        "profiles": [
            {
                "schedulerName": "default-scheduler",
                "plugins": {"score": {"disabled": [{"name": "NodeResourcesBalancedAllocation"}]}},
                "pluginConfig": [
                    {
                        "name": "NodeResourcesFit",
                        "args": {
                            "scoringStrategy": {
                                "type": "MostAllocated",
                                "resources": [
                                    {"name": "nvidia.com/gpu", "weight": 10},
                                    {"name": "cpu", "weight": 1},
                                    {"name": "memory", "weight": 1},
                                ],
                            }
                        },
                    }
                ],
            }
        ]
    }


SETTLED_PHASES = frozenset({"Running", "Queued", "Succeeded", "Failed"})

# The job mix: pairwise coprime lengths (11, 3, 4, 5), so the first 660 jobs are 660
# different combinations, and a dataset size of its own for every job on top.
MODELS = (
    "Qwen/Qwen2.5-0.5B",
    "meta-llama/Llama-3.2-1B",
    "Qwen/Qwen2.5-1.5B",
    "google/gemma-2-2b",
    "microsoft/phi-2",
    "meta-llama/Llama-3.2-3B",
    "Qwen/Qwen3-4B",
    "mistralai/Mistral-7B-v0.3",
    "Qwen/Qwen2.5-7B",
    "meta-llama/Llama-3.1-8B",
    "Qwen/Qwen2.5-14B",
)
METHODS = ("lora", "qlora", "full")
SEQUENCE_LENGTHS = (512, 1024, 2048, 4096)
GPU_COUNTS = (1, 2, 4, 8, 16)

QUIET_PER_S = 1.0
"""The cluster is quiet when fewer requests than this come per second, Leases and
non-resource URLs aside."""
WRITE_VERBS = frozenset({"PATCH", "PUT", "UPDATE", "APPLY"})


# ============================================================================ pure parts


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); NaN
    for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


class RequestKey(NamedTuple):
    """The labels of `apiserver_request_total` this benchmark tells apart."""

    verb: str
    group: str
    resource: str
    subresource: str
    code: str


K = TypeVar("K")
"""A counter's key: a `RequestKey`, or a resource's name for closed watches."""

_SAMPLE = re.compile(r"^(?P<name>\w+)\{(?P<labels>.*)\}\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _samples(text: str, metric: str) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of `metric` in a Prometheus text exposition (a
    timestamp after the value is ignored)."""
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is not None and match["name"] == metric:
            labels = {k: _unescape(v) for k, v in _LABEL.findall(match["labels"])}
            yield labels, float(match["value"])


def parse_request_totals(text: str) -> dict[RequestKey, float]:
    """`apiserver_request_total` of a Prometheus text exposition, summed over the labels
    `RequestKey` does not keep (version, scope, component, dry_run)."""
    totals: dict[RequestKey, float] = {}
    for labels, value in _samples(text, "apiserver_request_total"):
        key = RequestKey(
            verb=labels.get("verb", ""),
            group=labels.get("group", ""),
            resource=labels.get("resource", ""),
            subresource=labels.get("subresource", ""),
            code=labels.get("code", ""),
        )
        totals[key] = totals.get(key, 0.0) + value
    return totals


def parse_closed_watchers(text: str) -> dict[str, float]:
    """`apiserver_terminated_watchers_total` of a Prometheus text exposition by resource
    (`finetunejobs.kubetune.io`, `pods`): the watches the API server closed because the
    watcher's buffer stayed full (its log says "Forcing ... watcher close due to
    unresponsiveness"). A closed watch's client reconnects from its last resource version:
    nothing is lost, but what happened meanwhile reaches it late."""
    closed: dict[str, float] = {}
    for labels, value in _samples(text, "apiserver_terminated_watchers_total"):
        name = ".".join(x for x in (labels.get("resource", ""), labels.get("group", "")) if x)
        closed[name] = closed.get(name, 0.0) + value
    return closed


def closed_between(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """Watches closed between two readings of `parse_closed_watchers`, by resource."""
    return {k: int(v) for k, v in sorted(counter_delta(after, before).items())}


HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "apiserver_request_duration_seconds": ("verb", "resource", "subresource"),
    "apiserver_flowcontrol_request_wait_duration_seconds": ("priority_level", "execute"),
}
"""The API server's latency histograms the benchmark reads, and the labels it keeps: how
long requests took to serve, and how long API Priority and Fairness queued them first."""

_SERVED = "apiserver_request_duration_seconds"
LATENCIES = {
    "PATCH finetunejobs/status": (_SERVED, ("PATCH", "finetunejobs", "status")),
    "POST finetunejobs": (_SERVED, ("POST", "finetunejobs", "")),
    "POST jobs": (_SERVED, ("POST", "jobs", "")),
    "POST pods": (_SERVED, ("POST", "pods", "")),
}
"""Request latencies shown per run: the operator's status writes and batch Job creates, the
benchmark's creates and the Job controller's pod creates."""

Histograms = dict[tuple[str, tuple[str, ...]], dict[float, float]]


OPERATOR_VIEW_NAMES = {
    "kubetune_finetunejob_time_to_loop_seconds": "creation → loop started",
    "kubetune_reconcile_wait_seconds": "look's wait for a worker",
    "kubetune_finetunejob_time_to_plan_seconds": "creation → planned",
    "kubetune_event_loop_lag_seconds": "event-loop lag",
}
"""The operator's own histograms (its /metrics) that split creation → Planned, with the
names the report gives them: the API server's watch and the operator's event handling
(time to loop), the wait for a worker thread, and how late its event loop ran what was
due."""

OPERATOR_HISTOGRAMS: dict[str, tuple[str, ...]] = {name: () for name in OPERATOR_VIEW_NAMES}
"""`OPERATOR_VIEW_NAMES` as `parse_histograms` takes them: no label kept."""


def parse_histograms(text: str, kept: Mapping[str, tuple[str, ...]] = HISTOGRAMS) -> Histograms:
    """The buckets of the histograms `kept` names (default `HISTOGRAMS`) in a Prometheus
    text exposition, cumulative counts by upper bound, summed over the labels not kept."""
    out: Histograms = {}
    for line in text.splitlines():
        name, brace, rest = line.partition("_bucket{")
        if not brace or name not in kept:
            continue
        labels_text, _, value = rest.rpartition("} ")
        labels = {k: _unescape(v) for k, v in _LABEL.findall(labels_text)}
        key = (name, tuple(labels.get(k, "") for k in kept[name]))
        le = float(labels.get("le", "+Inf"))
        buckets = out.setdefault(key, {})
        buckets[le] = buckets.get(le, 0.0) + float(value)
    return out


def histogram_quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """Prometheus' `histogram_quantile` over cumulative buckets: linear inside the bucket
    that holds the rank; the largest finite bound when it falls in +Inf. None: no samples."""
    bounds = sorted(buckets)
    total = buckets.get(math.inf, buckets[bounds[-1]] if bounds else 0.0)
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def quantiles(buckets: Mapping[float, float]) -> dict[str, Any]:
    """Count, p50 and p99 of one histogram's cumulative buckets."""
    p50, p99 = histogram_quantile(buckets, 0.5), histogram_quantile(buckets, 0.99)
    return {
        "n": int(buckets.get(math.inf, 0.0)),
        "p50_s": None if p50 is None else round(p50, 3),
        "p99_s": None if p99 is None else round(p99, 3),
    }


def operator_view(text: str) -> dict[str, dict[str, Any]]:
    """`OPERATOR_HISTOGRAMS` from the operator's /metrics, over its whole run."""
    found = parse_histograms(text, OPERATOR_HISTOGRAMS)
    return {name: quantiles(buckets) for (name, _), buckets in sorted(found.items())}


def latency_summary(before: Histograms, after: Histograms) -> dict[str, dict[str, Any]]:
    """p50/p99 and count between two scrapes: the `LATENCIES` requests, and the wait in API
    Priority and Fairness' queues of every priority level that served requests."""

    def delta(key: tuple[str, tuple[str, ...]]) -> dict[float, float]:
        old = before.get(key, {})
        return {le: n - old.get(le, 0.0) for le, n in after.get(key, {}).items()}

    out = {name: quantiles(delta(key)) for name, key in LATENCIES.items()}
    for key in sorted(after):
        metric, (level, execute) = key[0], key[1][:2]
        if metric == "apiserver_flowcontrol_request_wait_duration_seconds" and execute == "true":
            waited = quantiles(delta(key))
            if waited["n"]:
                out[f"APF wait {level}"] = waited
    return out


def counter_delta(after: Mapping[K, float], before: Mapping[K, float]) -> dict[K, float]:
    """What each counter grew by; counters that did not grow are left out."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}


OwnKey = tuple[str, str, str]
"""(verb, resource, subresource) of a request the benchmark made itself."""


def local_tooling(key: RequestKey) -> bool:
    """The local provisioner's requests: it lists every PVC and PV twice a second, at a pace
    that depends on how busy the CPUs are (so a background window cannot take it out), and
    creates (409 until the claim is bound) and deletes PersistentVolumes. The operator creates
    claims but never lists them, and never touches a PersistentVolume."""
    if key.resource == "persistentvolumeclaims":
        return key.verb == "LIST"
    return key.resource == "persistentvolumes" and key.verb in ("LIST", "POST", "DELETE")


def never_the_operators(key: RequestKey) -> bool:
    """Requests the benchmark leaves out of the operator's count, whatever the window: the
    local provisioner's (`local_tooling`) and Event writes through `events.k8s.io/v1`, which
    the scheduler and controllers use (kopf, and so the operator, writes core/v1 Events).
    The scheduler re-reports every unschedulable pod in bursts minutes apart, which no
    background window of half a minute averages out."""
    return local_tooling(key) or key.group == "events.k8s.io"


def everything(_: RequestKey) -> bool:
    return True


@dataclass(frozen=True)
class Interval:
    """What `apiserver_request_total` grew by over some seconds, and the benchmark's own
    requests in that time."""

    delta: Mapping[RequestKey, float]
    own: Mapping[OwnKey, int]
    seconds: float

    def count(self, keep: Callable[[RequestKey], bool] = everything) -> float:
        """Requests `keep` accepts, less those `never_the_operators` and the benchmark's own (`keep`
        sees only verb, resource and subresource of those: their group and code are not
        known here)."""
        total = sum(v for k, v in self.delta.items() if keep(k) and not never_the_operators(k))
        mine = sum(
            n
            for (verb, res, sub), n in self.own.items()
            if keep(RequestKey(verb, "", res, sub, ""))
        )
        return total - mine

    def rate(self, keep: Callable[[RequestKey], bool] = everything) -> float:
        return self.count(keep) / self.seconds if self.seconds > 0 else math.nan


def beyond_background(
    interval: Interval, background: Interval, keep: Callable[[RequestKey], bool] = everything
) -> float:
    """Requests in `interval` beyond what the cluster does without the operator (`background`:
    kwok's node heartbeats and Leases, controllers' resyncs), at the background's rate."""
    return interval.count(keep) - background.rate(keep) * interval.seconds


def heartbeat_free(k: RequestKey) -> bool:
    """Neither kwok's Lease renewals nor a non-resource URL (discovery, health checks)."""
    return k.resource not in ("", "leases")


def is_list(k: RequestKey) -> bool:
    return k.verb == "LIST"


def is_status_write(k: RequestKey) -> bool:
    return k.resource == "finetunejobs" and k.subresource == "status" and k.verb in WRITE_VERBS


def batch_job_posts(delta: Mapping[RequestKey, float], code: str) -> int:
    return int(
        sum(
            v
            for k, v in delta.items()
            if (k.verb, k.group, k.resource, k.subresource, k.code)
            == ("POST", "batch", "jobs", "", code)
        )
    )


def own_delta(after: Mapping[OwnKey, int], before: Mapping[OwnKey, int]) -> Counter[OwnKey]:
    return Counter({k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)})


def breakdown(delta: Mapping[RequestKey, float]) -> dict[str, int]:
    """`VERB group/resource/subresource code` → count, largest first."""
    rows: Counter[str] = Counter()
    for k, v in delta.items():
        what = "/".join(
            p for p in (k.group or "core", k.resource or "(non-resource)", k.subresource) if p
        )
        rows[f"{k.verb} {what} {k.code}"] += int(v)
    return dict(rows.most_common())


def parse_breakdown_key(text: str) -> RequestKey:
    """The inverse of a `breakdown` key."""
    verb, rest = text.split(" ", 1)
    what, code = rest.rsplit(" ", 1)
    group, resource, *sub = what.split("/", 2)
    resource = "" if resource == "(non-resource)" else resource
    subresource = sub[0] if sub else ""
    return RequestKey(verb, "" if group == "core" else group, resource, subresource, code)


def own_key_text(key: OwnKey) -> str:
    return " ".join(part for part in key if part)


def _own_keys(stored: Mapping[str, int]) -> dict[OwnKey, int]:
    out: dict[OwnKey, int] = {}
    for text, count in stored.items():
        verb, resource, subresource = ([*text.split(" "), "", ""])[:3]
        out[(verb, resource, subresource)] = int(count)
    return out


def request_columns(record: Mapping[str, Any]) -> dict[str, float]:
    """The request columns of a run, from the counts its JSON line keeps (the breakdowns of
    the three windows and the benchmark's own requests), by the rules above."""
    own = record["own_requests"]
    if "create_to_steady" not in own:  # older lines: one total, nearly all of it creates
        own = {"create_to_steady": own, "steady_window": {}, "background_window": {}}

    def part(name: str, seconds: str) -> Interval:
        delta = {parse_breakdown_key(k): float(v) for k, v in record[f"requests_{name}"].items()}
        return Interval(delta, _own_keys(own[name]), float(record[seconds]))

    create = part("create_to_steady", "to_steady_s")
    window = part("steady_window", "window_s")
    background = part("background_window", "background_s")
    running = float(record["running_jobs"])

    def per_running_job(keep: Callable[[RequestKey], bool]) -> float:
        extra = beyond_background(window, background, keep)
        return extra / running / window.seconds if running else math.nan

    return {
        "requests_per_job": beyond_background(create, background) / int(record["jobs"]),
        "list_per_s": beyond_background(window, background, is_list) / window.seconds,
        "req_per_running_job_per_s": per_running_job(everything),
        "status_writes_per_running_job_per_min": 60 * per_running_job(is_status_write),
        "background_per_s": background.rate(),
    }


def running_stages(default_stages: str) -> str:
    """kwok's default Stage documents without `DROPPED_STAGES`: pods go Running and stay."""
    kept = []
    names = set()
    for doc in yaml.safe_load_all(default_stages):
        if not doc:
            continue
        name = str((doc.get("metadata") or {}).get("name", ""))
        names.add(name)
        if name not in DROPPED_STAGES:
            kept.append(doc)
    missing = {"pod-ready", "pod-delete", "node-initialize"} - names
    if missing:
        raise ValueError(
            f"kwok's stage file has no {', '.join(sorted(missing))} stage; to fix: rebuild the "
            "binaries (python -m kubetune_dev.binaries build) so the stage file matches kwok"
        )
    return yaml.safe_dump_all(kept, sort_keys=False)


def rfc3339_seconds(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class JobPlan:
    """One FineTuneJob to create: where, and the planner question it asks."""

    namespace: str
    name: str
    model: str
    method: str
    sequence_length: int
    num_examples: int
    gpus: int

    def question(self) -> tuple[str, str, int, int, int]:
        return (self.model, self.method, self.sequence_length, self.num_examples, self.gpus)

    def doc(self) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "FineTuneJob",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "model": {"uri": self.model},
                "dataset": {
                    "uri": "/data/train.jsonl",
                    "numExamples": self.num_examples,
                    "avgTokensPerExample": 300,
                },
                "method": self.method,
                "training": {"sequenceLength": self.sequence_length, "globalBatchSize": 32},
                "resources": {"gpus": self.gpus},
            },
        }


def job_mix(
    n: int, namespaces: int, feasible: Callable[[JobPlan], bool] = lambda _: True
) -> list[JobPlan]:
    """`n` jobs spread over `namespaces` namespaces, no two alike; a combination the planner
    cannot place gets the next method, then the next GPU count, that it can."""
    jobs = []
    for i in range(n):
        base = JobPlan(
            namespace=f"scale-{i % namespaces:02d}",
            name=f"ftj-{i:05d}",
            model=MODELS[i % len(MODELS)],
            method=METHODS[i % len(METHODS)],
            sequence_length=SEQUENCE_LENGTHS[i % len(SEQUENCE_LENGTHS)],
            num_examples=1000 + 13 * i,
            gpus=GPU_COUNTS[i % len(GPU_COUNTS)],
        )
        candidates = (
            replace(
                base,
                method=METHODS[(i + dm) % len(METHODS)],
                gpus=GPU_COUNTS[(i + dg) % len(GPU_COUNTS)],
            )
            for dg in range(len(GPU_COUNTS))
            for dm in range(len(METHODS))
        )
        chosen = next((c for c in candidates if feasible(c)), None)
        if chosen is None:
            raise ValueError(f"no method or GPU count of {GPU_COUNTS} fits {base.model}")
        jobs.append(chosen)
    return jobs


def planner_check(pools: Sequence[Mapping[str, Any]]) -> Callable[[JobPlan], bool]:
    """Whether the planner places a job on `pools` at all (free capacity aside)."""
    from kubetune.api.errors import KubetuneError
    from kubetune.api.v1alpha1 import FineTuneJobSpec, GPUPool
    from kubetune.planning.planner import plan_job
    from kubetune.sources import load_arch

    models = [GPUPool.model_validate(p) for p in pools]
    seen: dict[tuple[str, str, int, int], bool] = {}

    def feasible(job: JobPlan) -> bool:
        key = (job.model, job.method, job.sequence_length, job.gpus)
        if key not in seen:
            spec = FineTuneJobSpec.model_validate(job.doc()["spec"])
            try:
                plan_job(spec, models, load_arch(job.model, local_files=False))
                seen[key] = True
            except KubetuneError:
                seen[key] = False
        return seen[key]

    return feasible


def latencies(start: Mapping[Any, float], end: Mapping[Any, float]) -> list[float]:
    return [end[k] - start[k] for k in end if k in start]


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


# ============================================================================ the API server


class OwnRequests:
    """The requests this benchmark made, by (verb, resource, subresource)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[OwnKey] = Counter()

    def add(self, key: OwnKey) -> None:
        with self._lock:
            self._counts[key] += 1

    def snapshot(self) -> Counter[OwnKey]:
        with self._lock:
            return Counter(self._counts)


class Api:
    """HTTPS to the API server with the kubeconfig's client certificate; one connection per
    thread, kept alive."""

    def __init__(self, kubeconfig: Path, own: OwnRequests) -> None:
        config = yaml.safe_load(kubeconfig.read_text())
        context = _named(config["contexts"], config["current-context"])["context"]
        cluster = _named(config["clusters"], context["cluster"])["cluster"]
        user = _named(config["users"], context["user"])["user"]
        server = urlsplit(cluster["server"])
        self.host, self.port = server.hostname or "127.0.0.1", server.port or 443
        self.ssl = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.ssl.load_cert_chain(user["client-certificate"], user["client-key"])
        self.own = own
        self._local = threading.local()

    def connect(self, timeout: float | None = 60.0) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.ssl, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        key: OwnKey | None,
        body: bytes | None = None,
        accept: str = "application/json",
        content_type: str = "application/json",
    ) -> tuple[int, bytes]:
        headers = {"Accept": accept, "User-Agent": "kubetune-operator-scale-benchmark"}
        if body is not None:
            headers["Content-Type"] = content_type
        for attempt in (1, 2):
            conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self.connect()
            try:
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            if key is not None:
                self.own.add(key)
            return response.status, data
        raise AssertionError("unreachable")

    def get_json(self, path: str, key: OwnKey) -> dict[str, Any]:
        status, data = self.request("GET", path, key)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {data[:300]!r}")
        return dict(json.loads(data))

    def metrics_text(self) -> str:
        # /metrics itself is not counted in apiserver_request_total: no own key.
        status, data = self.request("GET", "/metrics", None, accept="text/plain")
        if status != 200:
            raise RuntimeError(f"GET /metrics: HTTP {status}: {data[:300]!r}")
        return data.decode(errors="replace")

    def request_totals(self, text: str | None = None) -> dict[RequestKey, float]:
        text = self.metrics_text() if text is None else text
        wanted = "\n".join(x for x in text.splitlines() if x.startswith("apiserver_request_total{"))
        return parse_request_totals(wanted)


def _named(entries: Iterable[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    for entry in entries:
        if entry.get("name") == name:
            return entry
    raise KeyError(f"the kubeconfig has no entry named {name!r}")


class Watch(threading.Thread):
    """LIST then WATCH a collection, handing every object to `on_event`; re-lists when the
    watch's resource version expires."""

    def __init__(
        self,
        api: Api,
        path: str,
        resource: str,
        on_event: Callable[[str, Mapping[str, Any]], None],
    ) -> None:
        super().__init__(name=f"watch-{resource}", daemon=True)
        self.api, self.path, self.resource, self.on_event = api, path, resource, on_event
        self.synced = threading.Event()
        self.errors = 0
        self._stopping = threading.Event()
        self._conn: http.client.HTTPSConnection | None = None

    def run(self) -> None:
        version: str | None = None
        while not self._stopping.is_set():
            try:
                if version is None:
                    data = self.api.get_json(self.path, ("LIST", self.resource, ""))
                    for item in data.get("items") or []:
                        self.on_event("ADDED", item)
                    version = str(data["metadata"]["resourceVersion"])
                    self.synced.set()
                version = self._stream(version)
            except (OSError, http.client.HTTPException, ValueError, RuntimeError, KeyError):
                if self._stopping.is_set():
                    return
                self.errors += 1
                version = None
                time.sleep(1.0)

    def _stream(self, version: str) -> str | None:
        sep = "&" if "?" in self.path else "?"
        path = (
            f"{self.path}{sep}watch=1&allowWatchBookmarks=true"
            f"&resourceVersion={version}&timeoutSeconds=300"
        )
        conn = self._conn = self.api.connect(timeout=None)
        try:
            conn.request("GET", path, headers={"Accept": "application/json"})
            self.api.own.add(("WATCH", self.resource, ""))
            response = conn.getresponse()
            if response.status != 200:
                response.read()
                return None
            while True:
                line = response.readline()
                if not line:
                    return version
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # 410 Gone: the version is too old; list again
                    return None
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind != "BOOKMARK":
                    self.on_event(str(kind), obj)
        finally:
            conn.close()

    def stop(self) -> None:
        self._stopping.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)


def first_events(kubeconfig: Path, out: Path) -> None:
    """Run as a process of its own (`--first-events`) until killed: write when a watch of
    FineTuneJobs first shows each job, one JSON line per job, after a first line once the
    watch's initial list is done. Nothing else shares this process, so the times are the API
    server's delivery of watch events, apart from the operator's event handling and from the
    benchmark's own creating clients."""
    api = Api(kubeconfig, OwnRequests())
    seen: set[str] = set()
    lock = threading.Lock()  # the watch's thread and this one both write lines
    with out.open("w", buffering=1) as f:

        def write(record: Mapping[str, Any]) -> None:
            with lock:
                f.write(json.dumps(record) + "\n")

        def on_event(kind: str, obj: Mapping[str, Any]) -> None:
            meta = obj.get("metadata") or {}
            key = f"{meta.get('namespace')}/{meta.get('name')}"
            if key not in seen:
                seen.add(key)
                write({"job": key, "at": time.time()})

        watch = Watch(api, f"/apis/{GROUP}/{VERSION}/finetunejobs", "finetunejobs", on_event)
        watch.start()
        watch.synced.wait()
        write({"synced": True})
        watch.join()


PLANNED_FLOOR_WRITERS = 8
"""Threads of `planned_floor_writer`, each with its own kept-alive connection (the default
of `--floor-writers`)."""


def planned_patch(at: dt.datetime) -> bytes:
    """The one status write of `planned_floor_writer`: a Planned condition decided `at`."""
    condition = {
        "type": "Planned",
        "status": "True",
        "reason": "PlanReady",
        "message": "written by the benchmark's minimal writer (--planned-floor)",
        "lastTransitionTime": at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return json.dumps({"status": {"conditions": [condition]}}).encode()


def floor_batch_job(namespace: str, job: str, pool: Mapping[str, Any]) -> bytes:
    """The one child of a job `planned_floor_writer` launches: a batch Job of one pod that
    asks for one GPU of `pool` (a GPUPool document: its nodeSelector and tolerations), labelled
    as the operator labels a job's children, so the benchmark's watches time it alike."""
    spec = pool.get("spec") or {}
    labels = {LABEL_JOB: job}
    pod = {
        "restartPolicy": "Never",
        "nodeSelector": dict(spec.get("nodeSelector") or {}),
        "tolerations": list(spec.get("tolerations") or []),
        "containers": [
            {
                "name": "trainer",
                "image": "kubetune-trainer:launch-floor",
                "resources": {"limits": {"nvidia.com/gpu": 1}},
            }
        ],
    }
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{job}-floor", "namespace": namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    return json.dumps(body).encode()


def _send(api: Api, method: str, path: str, body: bytes, content_type: str) -> None:
    """One write of `planned_floor_writer`, retried a few times on what may pass."""
    for delay in (0.2, 0.5, 1.0, 2.0, None):
        try:
            code, data = api.request(method, path, None, body, content_type=content_type)
        except (OSError, http.client.HTTPException) as exc:
            code, data = 0, str(exc).encode()
        if code in (200, 201) or delay is None or code not in (0, 409, 429, 500, 503):
            break
        time.sleep(delay)
    if code not in (200, 201):
        print(f"planned-floor writer: {method} {path}: HTTP {code}: {data[:200]!r}", flush=True)


def planned_floor_writer(
    kubeconfig: Path, ready: Path, launches: int = 0, threads: int = PLANNED_FLOOR_WRITERS
) -> None:
    """Run as a process of its own (`--planned-floor-writer`) until killed: watch
    FineTuneJobs and write each new job's Planned condition, decided when the watch shows
    the job, with one status PATCH from `threads` threads; `ready` is written once the
    watch's initial list is done. No planning, no Events: the least an operator that writes
    the condition can do, so how late these conditions come is the floor under the
    operator's creation → Planned on this cluster.

    The first `launches` jobs it sees it also launches, just before that write: one batch
    Job each (`floor_batch_job`, the simulated pools in turn), whose pod the Job controller
    creates and kube-scheduler binds. How late those pods come is the floor under the
    operator's creation → first pod."""
    api = Api(kubeconfig, OwnRequests())
    pools = pool_docs(1)
    todo: queue.SimpleQueue[tuple[str, str, dt.datetime, int]] = queue.SimpleQueue()
    seen: set[tuple[str, str]] = set()

    def on_event(kind: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        conditions = (obj.get("status") or {}).get("conditions") or []
        if kind == "DELETED" or key in seen or any(c.get("type") == "Planned" for c in conditions):
            return
        seen.add(key)
        todo.put((*key, dt.datetime.now(dt.UTC), len(seen)))

    def write() -> None:
        while True:
            namespace, name, at, nth = todo.get()
            path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/finetunejobs/{name}/status"
            if nth <= launches:  # the pod first: creation → first pod is what it times
                body = floor_batch_job(namespace, name, pools[nth % len(pools)])
                jobs = f"/apis/batch/v1/namespaces/{namespace}/jobs"
                _send(api, "POST", jobs, body, "application/json")
            _send(api, "PATCH", path, planned_patch(at), "application/merge-patch+json")

    for i in range(threads):
        threading.Thread(target=write, name=f"writer-{i}", daemon=True).start()
    watch = Watch(api, f"/apis/{GROUP}/{VERSION}/finetunejobs", "finetunejobs", on_event)
    watch.start()
    watch.synced.wait()
    ready.write_text("synced\n")
    watch.join()


def launch_latencies(t: Timings) -> dict[str, float]:
    """Creation → first batch Job and → first pod, and batch Job → first pod, p50 and p99,
    over the jobs that have one (NaN where none has); the keys of an operator run's record
    and of a launching `--planned-floor` run's."""
    out: dict[str, float] = {}
    for key, since, at in (
        ("batch_job", t.created, t.first_batch_job),
        ("pod", t.created, t.first_pod),
        ("pod_after_batch_job", t.first_batch_job, t.first_pod),
    ):
        lat = latencies(since, at)
        out[f"{key}_p50_s"] = percentile(lat, 50)
        out[f"{key}_p99_s"] = percentile(lat, 99)
    return out


def first_seen(path: Path) -> dict[tuple[str, str], float]:
    """What `first_events` wrote: (namespace, job) → when a watch first showed it."""
    out: dict[tuple[str, str], float] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "job" in record:
            namespace, _, name = str(record["job"]).partition("/")
            out[(namespace, name)] = float(record["at"])
    return out


def after_delivery(
    delivered: Mapping[tuple[str, str], float], planned: Mapping[tuple[str, str], float]
) -> dict[str, Any]:
    """Creation → Planned past the API server's delivery, job by job: when the operator
    decided the job's Planned condition less when the independent watch first saw the job.
    The API server serves the two watches apart, so the operator may come first (negative);
    the condition's time has 1 s resolution (truncated), which moves it down by up to a
    second. Empty when no job has both."""
    after = latencies(delivered, planned)
    if not after:
        return {}
    return {
        "plan_after_delivery_n": len(after),
        "plan_after_delivery_p50_s": percentile(after, 50),
        "plan_after_delivery_p99_s": percentile(after, 99),
    }


# ============================================================================ what happens


@dataclass
class JobState:
    created: float
    phase: str = ""
    planned_at: float | None = None
    """The Planned condition's lastTransitionTime: when the operator's look began."""
    planned_seen: float | None = None
    """When the watch first showed Planned=True (this machine's clock, the API server's
    too): when a user could see it, at most the watch's lag late."""
    planned_written: float | None = None
    """When the status write that carried Planned=True landed, by the API server's clock:
    the latest `managedFields` time of the status subresource in that first event (1 s
    resolution). Decision → written is the operator's part; written → seen the watch's."""
    not_planned_reason: str = ""
    pool: str = ""
    queued: bool = False
    """Seen Queued at some point: it waited for GPUs (capacity did not exist at creation)."""
    first_queued: str = ""
    """Why it was first Queued (the status message, numbers as N)."""


@dataclass
class Snapshot:
    jobs: int
    planned: int
    phases: Counter[str]
    pending_pods: int
    young_pending_pods: int
    """Pending for less than the operator waits before it moves a pod to another pool."""
    running_pods: int
    running_without_pods: int
    not_planned_reasons: Counter[str]
    volume_pending_pods: int = 0
    """Pending only because the scheduler waits for its volume claims to bind: the test
    cluster's volume binder still at work, not a place the pod cannot get."""
    pending_reasons: Counter[str] = field(default_factory=Counter)
    """Why the scheduler turned the Pending pods away (`unscheduled_reason`) → pods."""

    def settled(self, expected: int) -> bool:
        """Every job in a settled phase with pods for its attempt, and no pod still waiting
        for a place the operator might yet find it (an older Pending pod found none) or for
        its volumes to bind (the steady window would measure that backlog's aftermath)."""
        return (
            self.jobs == expected
            and all(phase in SETTLED_PHASES for phase in self.phases.elements())
            and self.young_pending_pods == 0
            and self.volume_pending_pods == 0
            and self.running_without_pods == 0
        )

    def signature(self) -> tuple[Any, ...]:
        return (tuple(sorted(self.phases.items())), self.running_pods, self.pending_pods)


def unscheduled_reason(status: Mapping[str, Any]) -> str | None:
    """The scheduler's PodScheduled=False message, its numbers replaced by N so that pods
    turned away for the same reason count together; None when the pod was not turned away."""
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return re.sub(r"\d+", "N", str(c.get("message") or c.get("reason") or "?"))
    return None


def status_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What a status write changed, as "<phase>: field, field" (a condition by its type):
    the steady window's writes counted by what they carried."""
    changed = sorted(
        k for k in old.keys() | new.keys() if k != "conditions" and old.get(k) != new.get(k)
    )
    conditions = {str(c.get("type")): c for c in old.get("conditions") or []}
    for c in new.get("conditions") or []:
        if conditions.get(str(c.get("type"))) != c:
            changed.append(f"conditions[{c.get('type')}]")
    return f"{new.get('phase') or '(none)'}: {', '.join(changed) or '(nothing)'}"


_POSITION = re.compile(r"position (\d+) in the queue")


def position_move(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """How a queued job's position moved between two statuses, by direction and by how far
    against the position shown before (the operator writes a move of less than a tenth
    less often); None unless both show one."""
    before = _POSITION.search(str(old.get("message") or ""))
    after = _POSITION.search(str(new.get("message") or ""))
    if before is None or after is None:
        return None
    shown, now = int(before.group(1)), int(after.group(1))
    if now == shown:
        return "unmoved"
    way = "forward" if now < shown else "back"
    far = "a tenth or more" if abs(now - shown) * 10 >= shown else "less than a tenth"
    return f"{way} {far}"


def _waits_for_volumes(reason: str) -> bool:
    """The scheduler's VolumeBinding plugin: "pod has unbound immediate
    PersistentVolumeClaims"."""
    return "PersistentVolumeClaim" in reason


class Timings(NamedTuple):
    """Per job (namespace, name), server clock, 1 s resolution."""

    created: dict[tuple[str, str], float]
    planned: dict[tuple[str, str], float]
    first_batch_job: dict[tuple[str, str], float]
    first_pod: dict[tuple[str, str], float]
    queued: frozenset[tuple[str, str]]
    """Jobs seen Queued at some point."""
    planned_seen: dict[tuple[str, str], float]
    planned_written: dict[tuple[str, str], float]


def status_written_at(meta: Mapping[str, Any]) -> float | None:
    """The latest time a manager wrote the object's status subresource (`managedFields`)."""
    times = [
        rfc3339_seconds(str(entry["time"]))
        for entry in meta.get("managedFields") or []
        if entry.get("subresource") == "status" and entry.get("time")
    ]
    return max(times) if times else None


class Tracker:
    """FineTuneJobs and trainer pods as the watches see them."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self.clock = clock
        self.jobs: dict[tuple[str, str], JobState] = {}
        self.first_pod: dict[tuple[str, str], float] = {}
        self.first_batch_job: dict[tuple[str, str], float] = {}
        """(namespace, job) → creation time of its first batch Job: the operator's part of
        creation → first pod ends there; the Job controller's part begins."""
        self.pods: dict[tuple[str, str], tuple[tuple[str, str], str, float]] = {}
        """(namespace, pod) → (namespace, job), phase, creation time."""
        self.unscheduled: dict[tuple[str, str], str] = {}
        """Pending pods the scheduler turned away → its reason (`unscheduled_reason`)."""
        self.phase_changes = 0
        self.statuses: dict[tuple[str, str], dict[str, Any]] = {}
        """Each job's status as last seen (`status_changes` compares against it)."""
        self.counting_writes = False
        self.steady_seen = False
        """Set when the steady window begins: `burst_writes` stops counting."""
        self.writes: Counter[str] = Counter()
        """While `counting_writes`: what each status change the watch showed changed
        (`status_changes`) → how many."""
        self.moves: Counter[str] = Counter()
        """While `counting_writes`: queued jobs' position moves (`position_move`) → how
        many."""
        self.burst_writes: Counter[str] = Counter()
        """Until the steady window: what each status change the watch showed changed, a
        queued job's move counted as `<phase>: position <move>` (creation → steady)."""
        self.last_phase_change = 0.0
        """When (monotonic) the watch last showed a job change phase."""

    def on_job(self, kind: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if kind == "DELETED":
            return
        status = obj.get("status") or {}
        with self._lock:
            state = self.jobs.get(key)
            if state is None:
                state = self.jobs[key] = JobState(rfc3339_seconds(meta["creationTimestamp"]))
            before = self.statuses.get(key)
            self.statuses[key] = status
            counting = self.counting_writes or not self.steady_seen
            if counting and before is not None and before != status:
                what = status_changes(before, status)
                move = position_move(before, status)
                if self.counting_writes:
                    self.writes[what] += 1
                    if move is not None:
                        self.moves[move] += 1
                elif not self.steady_seen:
                    self.burst_writes[what if move is None else f"{what}; position {move}"] += 1
            phase = str(status.get("phase") or "")
            if phase != state.phase:
                self.phase_changes += 1
                self.last_phase_change = time.monotonic()
                state.phase = phase
            if phase == "Queued" and not state.queued:
                state.queued = True
                state.first_queued = re.sub(r"\d+", "N", str(status.get("message") or ""))[:160]
            state.pool = str((status.get("plan") or {}).get("pool") or "")
            for cond in status.get("conditions") or []:
                if cond.get("type") != "Planned":
                    continue
                if cond.get("status") == "True" and state.planned_at is None:
                    state.planned_at = rfc3339_seconds(cond["lastTransitionTime"])
                    state.planned_seen = self.clock()
                    state.planned_written = status_written_at(meta)
                elif cond.get("status") != "True":
                    state.not_planned_reason = str(cond.get("reason") or "")

    @staticmethod
    def _keep_first(
        first: dict[tuple[str, str], float], meta: Mapping[str, Any]
    ) -> tuple[tuple[str, str], float]:
        """Record a child's creation time if it is its job's first; (job, creation time)."""
        job = (str(meta.get("namespace")), str((meta.get("labels") or {}).get(LABEL_JOB)))
        created = rfc3339_seconds(meta["creationTimestamp"])
        if created < first.get(job, math.inf):
            first[job] = created
        return job, created

    def on_pod(self, kind: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        with self._lock:
            job, created = self._keep_first(self.first_pod, meta)
            self.unscheduled.pop(key, None)
            if kind == "DELETED" or meta.get("deletionTimestamp"):
                self.pods.pop(key, None)
            else:
                status = obj.get("status") or {}
                phase = str(status.get("phase") or "Pending")
                self.pods[key] = (job, phase, created)
                reason = unscheduled_reason(status) if phase == "Pending" else None
                if reason is not None:
                    self.unscheduled[key] = reason

    def on_batch_job(self, kind: str, obj: Mapping[str, Any]) -> None:
        with self._lock:
            self._keep_first(self.first_batch_job, obj.get("metadata") or {})

    def snapshot(self, now: float, patience: float) -> Snapshot:
        """The state at `now` (epoch seconds); a Pending pod younger than `patience` seconds
        is young."""
        with self._lock:
            phases = Counter(s.phase or "(none)" for s in self.jobs.values())
            pod_phases = Counter(phase for _, phase, _ in self.pods.values())
            with_pods = {job for job, _, _ in self.pods.values()}
            running_jobs = [k for k, s in self.jobs.items() if s.phase == "Running"]
            return Snapshot(
                jobs=len(self.jobs),
                planned=sum(1 for s in self.jobs.values() if s.planned_at is not None),
                phases=phases,
                pending_pods=pod_phases["Pending"],
                young_pending_pods=sum(
                    1
                    for _, phase, created in self.pods.values()
                    if phase == "Pending" and now - created < patience
                ),
                running_pods=pod_phases["Running"],
                volume_pending_pods=sum(
                    1 for r in self.unscheduled.values() if _waits_for_volumes(r)
                ),
                pending_reasons=Counter(self.unscheduled.values()),
                running_without_pods=sum(1 for k in running_jobs if k not in with_pods),
                not_planned_reasons=Counter(
                    s.not_planned_reason or "(no Planned condition)"
                    for s in self.jobs.values()
                    if s.planned_at is None
                ),
            )

    def first_queued(self) -> dict[str, int]:
        """How many jobs were first Queued for each reason, commonest first."""
        with self._lock:
            found = Counter(s.first_queued for s in self.jobs.values() if s.queued)
        return dict(found.most_common(8))

    def timings(self) -> Timings:
        with self._lock:
            created = {k: s.created for k, s in self.jobs.items()}
            planned = {k: s.planned_at for k, s in self.jobs.items() if s.planned_at is not None}
            queued = frozenset(k for k, s in self.jobs.items() if s.queued)
            seen = {k: s.planned_seen for k, s in self.jobs.items() if s.planned_seen is not None}
            written = {
                k: s.planned_written for k, s in self.jobs.items() if s.planned_written is not None
            }
            return Timings(
                created,
                planned,
                dict(self.first_batch_job),
                dict(self.first_pod),
                queued,
                seen,
                written,
            )

    def pools(self) -> dict[str, int]:
        with self._lock:
            return dict(Counter(s.pool or "(none)" for s in self.jobs.values()))


@dataclass
class ProcSample:
    cpu_s: float
    rss_kib: int
    hwm_kib: int


def proc_sample(pid: int) -> ProcSample:
    """CPU seconds (user + system) and resident memory of a process, from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            values[name] = int(rest.split()[0])
    return ProcSample(ticks / os.sysconf("SC_CLK_TCK"), values["VmRSS"], values["VmHWM"])


def sched_autogroup(path: Path = Path("/proc/sys/kernel/sched_autogroup_enabled")) -> bool | None:
    """Whether the kernel shares the cores between sessions (autogroups) rather than
    threads: every component runs in a session of its own, so where it does, a busy operator
    leaves the API server about half the machine (docs/local-cluster.md). None: unknown."""
    try:
        return path.read_text().strip() == "1"
    except OSError:
        return None


def sharing(record: Mapping[str, Any]) -> str:
    """How the kernel shared the cores in a run (`sched_autogroup`), in words."""
    autogroup = record.get("sched_autogroup")
    if autogroup is None:
        return "how the kernel shared the cores between processes: not recorded"
    if autogroup:
        return "the kernel shared the cores between sessions (autogroup), each component one"
    return "the kernel shared the cores between threads (no autogroup)"


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def machine_cpu(stat: Path = Path("/proc/stat")) -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine since boot, every core summed, from the
    first line of /proc/stat (busy: everything but idle and iowait)."""
    fields = [int(v) for v in stat.read_text().splitlines()[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


def cpu_split(
    before: Mapping[str, float], after: Mapping[str, float], seconds: float
) -> dict[str, float]:
    """CPU seconds each process (and the machine, `machine busy`) spent between two
    `Bench.cpu_sample`s, largest first, with `machine cores busy` (busy seconds per second of
    the interval) last; processes in only one sample are left out."""
    spent = {k: round(after[k] - before[k], 1) for k in after if k in before}
    out = dict(sorted(spent.items(), key=lambda kv: -kv[1]))
    if seconds > 0 and "machine busy" in spent:
        out["machine cores busy"] = round(spent["machine busy"] / seconds, 2)
    return out


def running_apiservers(proc: Path = Path("/proc")) -> list[int]:
    """The pids of the kube-apiservers running on this machine: another control plane (a
    test run stopped before its teardown, a second benchmark) shares the cores and makes a
    run's latencies incomparable, so a run counts them before it starts its own."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if Path(argv0.decode(errors="replace")).name == "kube-apiserver":
            pids.append(int(entry.name))
    return sorted(pids)


# ============================================================================ the run


OPERATOR_DEFAULTS = {
    # The jobs name hub models; with the stage-in step on, each would first run a CPU pod
    # that fetches its model into the namespace's cache, which kwok's nodes (GPU-tainted,
    # pods that never complete) cannot run: the trainer fetches instead, as a job whose
    # model the stage-in step leaves alone does.
    "KUBETUNE_STAGE_IN_HUB": "false",
    # The 16-GPU jobs span two nodes, which the planner offers only with ReadWriteMany
    # checkpoint volumes; the local provisioner serves them.
    "KUBETUNE_CHECKPOINT_READ_WRITE_MANY": "true",
}
"""The operator's environment unless --operator-env says otherwise."""


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


def pool_docs(nodes_per_pool: int) -> list[dict[str, Any]]:
    from kubetune_dev.cli import simulated_pool_docs

    docs = simulated_pool_docs()
    for doc in docs:
        doc["spec"]["maxNodes"] = nodes_per_pool
    return docs


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
        """This script as a process of its own (`main`'s `flag`), given the kubeconfig,
        `out`, a file it writes a first line to once its watch of FineTuneJobs has listed,
        and `more`."""
        argv = [sys.executable, __file__, flag, str(self.cluster.kubeconfig), str(out), *more]
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


# ============================================================================ reporting

COLUMNS = (
    ("time", "time"),
    ("label", "label"),
    ("commit", "commit"),
    ("setup", "pools×nodes×GPUs, ns, clients"),
    ("jobs", "jobs"),
    ("not_planned", "not Planned"),
    ("plan", "→Planned p50 / p99 s"),
    ("batch_job", "→batch Job p50 / p99 s"),
    ("pod", "→first pod p50 / p99 s"),
    ("planned_per_s", "Planned jobs/s"),
    ("to_steady", "→steady s"),
    ("running", "Running / Queued jobs"),
    ("rss", "RSS peak MiB"),
    ("cpu", "CPU %"),
    ("req_job", "requests/job"),
    ("lists", "LIST/s"),
    ("req_run", "req/running job/s"),
    ("status", "status writes/running job/min"),
    ("post409", "Job POST 409"),
    ("load", "load avg start → end"),
)


def control_plane_text(r: Mapping[str, Any]) -> str:
    parts = []
    if r.get("client_qps"):
        parts.append(f"controller-manager and scheduler QPS {r['client_qps']}")
    if r.get("bin_packing"):
        parts.append("GPU bin packing")
    return "".join(f"; {p}" for p in parts)


def row_values(r: Mapping[str, Any]) -> dict[str, str]:
    return {
        "time": f"{r['date']} {r['time']}",
        "label": str(r["label"]),
        "commit": str(r["commit"]),
        "setup": f"{r['pools']}, {r['namespaces']}, {r['clients']}" + control_plane_text(r),
        "jobs": str(r["jobs"]),
        "not_planned": str(r["not_planned"]),
        "plan": f"{fmt(r['plan_p50_s'], 0)} / {fmt(r['plan_p99_s'], 0)}"
        + (
            f" (written {fmt(r['plan_written_p50_s'], 0)} / {fmt(r['plan_written_p99_s'], 0)})"
            if r.get("plan_written_p50_s") is not None
            else ""
        )
        + (
            f" (seen {fmt(r['plan_seen_p50_s'], 0)} / {fmt(r['plan_seen_p99_s'], 0)})"
            if "plan_seen_p50_s" in r
            else ""
        )
        + (
            f" (after delivery {fmt(r['plan_after_delivery_p50_s'], 0)} / "
            f"{fmt(r['plan_after_delivery_p99_s'], 0)})"
            if "plan_after_delivery_p50_s" in r
            else ""
        ),
        "batch_job": f"{fmt(r.get('batch_job_p50_s'), 0)} / {fmt(r.get('batch_job_p99_s'), 0)}",
        "pod": f"{fmt(r['pod_p50_s'], 0)} / {fmt(r['pod_p99_s'], 0)}"
        + (
            f" (never Queued: {fmt(r['pod_at_once_p50_s'], 0)} / {fmt(r['pod_at_once_p99_s'], 0)},"
            f" {r['jobs_launched_at_once']} jobs)"
            if "jobs_launched_at_once" in r
            else ""
        ),
        "planned_per_s": fmt(r["planned_per_s"]),
        "to_steady": fmt(r["to_steady_s"], 0) + ("" if r["steady"] else " (not steady)"),
        "running": f"{r['phases'].get('Running', 0)} / {r['phases'].get('Queued', 0)}"
        + (f" ({r['pending_pods']} pods Pending)" if r.get("pending_pods") else ""),
        "rss": fmt(r["rss_peak_mib"], 0),
        "cpu": fmt(r["cpu_pct"]),
        "req_job": fmt(r["requests_per_job"]),
        "lists": fmt(r["list_per_s"], 2),
        "req_run": fmt(r["req_per_running_job_per_s"], 3),
        "status": fmt(r["status_writes_per_running_job_per_min"], 2),
        "post409": str(r["job_post_409"]),
        "load": f"{r['load_start']} → {r['load_end']}"
        + (
            f"; {r['other_apiservers']} other control plane(s) running"
            if r.get("other_apiservers")
            else ""
        ),
    }


def table_header() -> str:
    names = [title for _, title in COLUMNS]
    return "| " + " | ".join(names) + " |\n|" + "|".join(" --- " for _ in names) + "|\n"


def table_row(r: Mapping[str, Any]) -> str:
    values = row_values(r)
    return "| " + " | ".join(values[key] for key, _ in COLUMNS) + " |\n"


def results_preamble(date: str) -> str:
    return (
        f"# The operator at scale — {date}\n\n"
        "Made by `python benchmarks/operator_scale.py --jobs N --label LABEL`, one row per run "
        "(docs/local-cluster.md#the-operator-at-scale says what each column means; the JSON "
        "lines in the `.jsonl` beside this file have every detail, the API requests by verb and "
        "resource among them).\n\n"
        "- Local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, "
        "kwok) on one 2-core machine shared with other work: the load average column says how "
        "busy it was. The operator runs as its own process with its default settings unless "
        "the label says otherwise.\n"
        "- Pools: rtx4090-spot, l40s, a100-80gb and h100 of the built-in catalog, kwok nodes of "
        "8 GPUs each. Trainer pods stay Running (kwok's stages without `pod-complete`) and have "
        "loopback addresses, so the operator's metric scrapes are refused at once.\n"
        "- Jobs: 11 models of the built-in table × full/lora/qlora × sequence 512–4096 × "
        "1–16 GPUs, a dataset size of their own each; all created at once.\n\n" + table_header()
    )


def write_results(path: Path, result: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(results_preamble(str(result["date"])))
    with path.open("a") as fh:
        fh.write(table_row(result))
    with path.with_suffix(".jsonl").open("a") as fh:
        fh.write(json.dumps(result, default=_json_default) + "\n")


DELIVERY_COLUMNS = (
    "time",
    "label",
    "commit",
    "jobs, clients",
    "created in s",
    "→ seen by a watch p50 / p99 / max s",
    "CPU s while creating (cores busy)",
    "load avg start → end",
)
FLOOR_COLUMNS = (
    *DELIVERY_COLUMNS[:6],
    "→ Planned decided p50 / p99 / max s",
    "→ Planned written p50 / p99 s",
    "→ Planned seen p50 / p99 s",
    "writer threads, jobs launched",
    "→ batch Job p50 / p99 s",
    "→ first pod p50 / p99 s (after its batch Job)",
    *DELIVERY_COLUMNS[6:],
)


def delivery_row(r: Mapping[str, Any]) -> str:
    cpu = r.get("cpu_s_creation") or {}
    top = ", ".join(
        f"{name} {value}"
        for name, value in cpu.items()
        if name not in ("machine busy", "machine cores busy")
    )
    values: tuple[str, ...] = (
        f"{r['date']} {r['time']}",
        r["label"],
        r["commit"],
        f"{r['jobs']}, {r['clients']}",
        fmt(r["create_s"]),
        f"{fmt(r['delivered_p50_s'])} / {fmt(r['delivered_p99_s'])} / {fmt(r['delivered_max_s'])}",
    )
    if r.get("mode") == "planned floor":
        values += (
            f"{fmt(r['plan_p50_s'], 0)} / {fmt(r['plan_p99_s'], 0)} / {fmt(r['plan_max_s'], 0)}",
            f"{fmt(r['plan_written_p50_s'], 0)} / {fmt(r['plan_written_p99_s'], 0)}",
            f"{fmt(r['plan_seen_p50_s'])} / {fmt(r['plan_seen_p99_s'])}",
            *launch_cells(r),
        )
    values += (
        f"{top} ({cpu.get('machine cores busy', '?')} of {os.cpu_count()})",
        f"{r['load_start']} → {r['load_end']}",
    )
    return "| " + " | ".join(str(v) for v in values) + " |\n"


def launch_cells(r: Mapping[str, Any]) -> tuple[str, str, str]:
    """The floor table's launch columns; dashes for a run that launched nothing."""
    threads = f"{r.get('floor_writers', PLANNED_FLOOR_WRITERS)}, {r.get('launched') or 0}"
    if not r.get("launched"):
        return (threads, "–", "–")
    return (
        threads,
        f"{fmt(r.get('batch_job_p50_s'), 0)} / {fmt(r.get('batch_job_p99_s'), 0)}",
        f"{fmt(r.get('pod_p50_s'), 0)} / {fmt(r.get('pod_p99_s'), 0)} "
        f"({fmt(r.get('pod_after_batch_job_p50_s'), 0)} / "
        f"{fmt(r.get('pod_after_batch_job_p99_s'), 0)})",
    )


def write_delivery_results(path: Path, result: Mapping[str, Any]) -> None:
    """A `--without-operator` run: a row of its own table (apiserver-delivery-<date>.md) and
    its JSON line beside it; a `--planned-floor` run likewise (planned-floor-<date>.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        columns: tuple[str, ...] = DELIVERY_COLUMNS
        title, flag = "The API server's delivery without the operator", "--without-operator"
        what = (
            "How soon a watch in a process of its own first sees each job after its creation "
            "is the floor under the operator's creation → Planned."
        )
        if result.get("mode") == "planned floor":
            columns = FLOOR_COLUMNS
            title, flag = "Creation → Planned with the least an operator can do", "--planned-floor"
            what = (
                "In its stead a process of the benchmark's own watches FineTuneJobs and writes "
                "each new job's Planned condition, decided when its watch shows the job, with "
                "one status PATCH from its threads (`--floor-writers`, default "
                f"{PLANNED_FLOOR_WRITERS}): no planning, no "
                "Events. How late these conditions come (server clock, 1 s resolution) is "
                "the floor under the operator's creation → Planned on this cluster. With "
                "`--floor-launches N` it also launches the first N jobs it sees, just before "
                "that write: one batch Job of one pod asking for one GPU of a simulated pool "
                "(the pools in turn), which the Job controller and kube-scheduler take from "
                "there: the floor under creation → first pod."
            )
        path.write_text(
            f"# {title} — {result['date']}\n\n"
            f"Made by `python benchmarks/operator_scale.py {flag}`: the local control plane, "
            "kwok pools and jobs of operator-scale, created by the same clients, with no "
            f"operator running. {what} CPU seconds by process while the jobs were created "
            "(benchmark: its creating clients and its own watches).\n\n"
            "| " + " | ".join(columns) + " |\n" + "|" + " --- |" * len(columns) + "\n"
        )
    with path.open("a") as fh:
        fh.write(delivery_row(result))
    with path.with_suffix(".jsonl").open("a") as fh:
        fh.write(json.dumps(result, default=_json_default) + "\n")


def delivery_report(r: Mapping[str, Any]) -> str:
    floor = r.get("mode") == "planned floor"
    planned = (
        [
            f"  creation → Planned by the minimal writer p50 {fmt(r['plan_p50_s'], 0)}s "
            f"p99 {fmt(r['plan_p99_s'], 0)}s max {fmt(r['plan_max_s'], 0)}s "
            f"(decided); written p50 {fmt(r['plan_written_p50_s'], 0)}s p99 "
            f"{fmt(r['plan_written_p99_s'], 0)}s; seen by a watch p50 "
            f"{fmt(r['plan_seen_p50_s'])}s p99 {fmt(r['plan_seen_p99_s'])}s"
        ]
        if floor
        else []
    )
    if r.get("launched"):

        def p50_p99(key: str) -> str:
            return f"{fmt(r.get(f'{key}_p50_s'), 0)} / {fmt(r.get(f'{key}_p99_s'), 0)}s"

        planned.append(
            f"  {r['launched']} jobs launched by the minimal writer: creation → batch Job "
            f"p50 / p99 {p50_p99('batch_job')}, → first pod {p50_p99('pod')}; batch Job → "
            f"first pod {p50_p99('pod_after_batch_job')}"
        )
    return "\n".join(
        [
            f"without the operator{', the minimal writer instead' if floor else ''}, "
            f"{r['jobs']} jobs, label {r['label']!r}",
            f"  created in {r['create_s']}s by {r['clients']} clients: {r['create_outcomes']}",
            f"  creation → first seen by a watch in a process of its own p50 "
            f"{fmt(r['delivered_p50_s'])}s p99 {fmt(r['delivered_p99_s'])}s max "
            f"{fmt(r['delivered_max_s'])}s; all seen {r['all_seen_s']}s after the first create",
            *planned,
            f"  CPU s while creating: {r['cpu_s_creation']}",
            f"  CPU s until all were seen: {r['cpu_s_to_all_seen']}",
            f"  watches the API server closed as unresponsive meanwhile: "
            f"{r.get('watches_closed_create_to_seen', 'not read') or 'none'}",
            f"  load average {r['load_start']} → {r['load_end']}; {sharing(r)}",
        ]
    )


def rescore(jsonl: Path) -> list[dict[str, Any]]:
    """Derive the request columns of every run in `jsonl` again from its stored counts, by
    the current rules, and rewrite it and the table rows of the .md beside it (what is
    above the table stays)."""
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    for record in records:
        record.update(request_columns(record))
    jsonl.write_text("".join(json.dumps(r, default=_json_default) + "\n" for r in records))
    md = jsonl.with_suffix(".md")
    if md.exists():
        text = md.read_text()
        head = text.index(table_header())
        md.write_text(text[: head + len(table_header())] + "".join(table_row(r) for r in records))
    return records


def _json_default(value: object) -> object:
    if isinstance(value, Counter):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def after_delivery_text(r: Mapping[str, Any]) -> str:
    return (
        f"  Planned decided after that delivery, job by job (negative: before it; 1 s "
        f"resolution) p50 {fmt(r.get('plan_after_delivery_p50_s'))}s p99 "
        f"{fmt(r.get('plan_after_delivery_p99_s'))}s ({r.get('plan_after_delivery_n')} jobs)"
    )


def report(r: Mapping[str, Any]) -> str:
    lines = [
        f"operator {r['commit']} ({r['operator_source']}), {r['jobs']} jobs, label {r['label']!r}",
        f"  created in {r['create_s']}s by {r['clients']} clients: {r['create_outcomes']}",
        f"  Planned: {r['planned']}/{r['jobs']} (not Planned: {r['not_planned_reasons'] or 0}); "
        f"{fmt(r['planned_per_s'])} jobs/s",
        f"  creation → Planned    p50 {fmt(r['plan_p50_s'])}s  p99 {fmt(r['plan_p99_s'])}s  "
        f"max {fmt(r['plan_max_s'])}s (decided); written p50 "
        f"{fmt(r.get('plan_written_p50_s'))}s p99 {fmt(r.get('plan_written_p99_s'))}s; seen by "
        f"a watch p50 {fmt(r.get('plan_seen_p50_s'))}s p99 {fmt(r.get('plan_seen_p99_s'))}s",
        f"  creation → first pod  p50 {fmt(r['pod_p50_s'])}s  p99 {fmt(r['pod_p99_s'])}s  "
        f"({r['jobs_with_pods']} jobs had pods)",
        f"  creation → first seen by a watch in a process of its own (the API server's "
        f"delivery) p50 {fmt(r.get('delivered_p50_s'))}s p99 {fmt(r.get('delivered_p99_s'))}s "
        f"({r.get('delivered_n')} jobs)",
        after_delivery_text(r),
        "  the operator's own split (its histograms, whole run, p50 / p99 s): "
        + (
            ", ".join(
                f"{OPERATOR_VIEW_NAMES.get(name, name)} {fmt(v['p50_s'], 2)} / "
                f"{fmt(v['p99_s'], 2)} ({v['n']})"
                for name, v in (r.get("operator_view") or {}).items()
            )
            or "not read"
        ),
        f"  CPU s while creating: {r.get('cpu_s_creation')}",
        f"  CPU s creation → steady: {r.get('cpu_s_to_steady_by_process')}",
        f"  jobs never Queued ({r.get('jobs_launched_at_once')}): creation → first pod p50 "
        f"{fmt(r.get('pod_at_once_p50_s'))}s  p99 {fmt(r.get('pod_at_once_p99_s'))}s",
        f"  first Queued because: {r.get('first_queued')}",
        f"  creation → batch Job  p50 {fmt(r.get('batch_job_p50_s'))}s  p99 "
        f"{fmt(r.get('batch_job_p99_s'))}s (the operator's part); batch Job → pod p50 "
        f"{fmt(r.get('pod_after_batch_job_p50_s'))}s  p99 "
        f"{fmt(r.get('pod_after_batch_job_p99_s'))}s (the Job controller's)",
        f"  steady: {r['steady']} after {r['to_steady_s']}s; phases {r['phases']}; "
        f"trainer pods Running {r['running_pods']}, Pending {r['pending_pods']} "
        f"({r.get('volume_pending_pods', '?')} of them for volume binding; scheduler: "
        f"{r.get('pending_reasons', '?')}); "
        f"pools {r['pools_chosen']}",
        f"  window {r['window_s']}s ({r['window_phase_changes']} phase changes): operator RSS "
        f"peak {fmt(r['rss_peak_mib'])} MiB (lifetime peak {fmt(r['rss_hwm_mib'])}), CPU "
        f"{fmt(r['cpu_pct'])}% of a core; {fmt(r['cpu_s_to_steady'])} CPU s creation → steady",
        f"  status changes creation → steady, by what they changed (most frequent 10): "
        f"{r.get('burst_status_changes', '?')}",
        f"  status changes in the window, by what they changed: "
        f"{r.get('window_status_changes', '?')}; queued jobs' position moves: "
        f"{r.get('window_position_moves', '?')}, the window beginning "
        f"{r.get('window_after_phase_change_s', '?')} s after the last phase change",
        f"  API: {fmt(r['requests_per_job'])} requests/job creation → steady; steady: "
        f"{fmt(r['list_per_s'], 2)} LIST/s, {fmt(r['req_per_running_job_per_s'], 3)} "
        f"req/running job/s, {fmt(r['status_writes_per_running_job_per_min'], 2)} status "
        f"writes/running job/min; batch Job POSTs 201: {r['job_post_201']}, 409: "
        f"{r['job_post_409']}",
        f"  load average {r['load_start']} → {r['load_end']}; {sharing(r)}",
        f"  watches the API server closed as unresponsive, creation → steady: "
        f"{r.get('watches_closed_create_to_steady', 'not read') or 'none'}",
        "  API server latency creation → steady, p50 / p99 s (requests): "
        + ", ".join(
            f"{name} {fmt(v['p50_s'], 3)} / {fmt(v['p99_s'], 3)} ({v['n']})"
            for name, v in (r.get("latency_create_to_steady") or {}).items()
        ),
        "  steady-window requests (all clients): "
        + ", ".join(f"{k} {v}" for k, v in list(r["requests_steady_window"].items())[:12]),
    ]
    return "\n".join(lines)


# ============================================================================ command line


def parse_args(argv: Sequence[str] | None = None) -> Options:
    from kubetune_dev.cluster import default_root

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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


if __name__ == "__main__":
    raise SystemExit(main())
