"""Which requests are the operator's: the API server counts every client's requests
together (`apiserver_request_total` has no user label), so a run subtracts its own, those
that are never the operator's and the cluster's background rate; and the latencies a run
reports, from the API server's histograms and from the operator's own."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks.measure import Histograms, RequestKey, parse_histograms, quantiles

QUIET_PER_S = 1.0
"""The cluster is quiet when fewer requests than this come per second, Leases and
non-resource URLs aside."""
WRITE_VERBS = frozenset({"PATCH", "PUT", "UPDATE", "APPLY"})


_SERVED = "apiserver_request_duration_seconds"
LATENCIES = {
    "PATCH finetunejobs/status": (_SERVED, ("PATCH", "finetunejobs", "status")),
    "POST finetunejobs": (_SERVED, ("POST", "finetunejobs", "")),
    "POST jobs": (_SERVED, ("POST", "jobs", "")),
    "POST pods": (_SERVED, ("POST", "pods", "")),
}
"""Request latencies shown per run: the operator's status writes and batch Job creates, the
benchmark's creates and the Job controller's pod creates."""

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
