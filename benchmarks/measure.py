"""What the benchmarks measure with, defined once: percentiles, counter deltas, the API
server's counters and histograms (its Prometheus text exposition), and processes and the
machine as /proc shows them.

Pure functions of their inputs (a /proc reader takes its path, so a test can hand it a file),
no dependency beyond the standard library.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

# ============================================================================ percentiles


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


def nearest_rank(ascending: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of an ascending, non-empty list by nearest rank: always
    one of the values (a time that was measured, not one between two)."""
    rank = max(1, -(-len(ascending) * q // 100))
    return ascending[int(rank) - 1]


K = TypeVar("K")
"""A counter's key: a `RequestKey`, a resource's name, a process's name."""


def counter_delta(after: Mapping[K, float], before: Mapping[K, float]) -> dict[K, float]:
    """What each counter grew by; counters that did not grow are left out."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}


# ============================================================================ the API server


class RequestKey(NamedTuple):
    """The labels of `apiserver_request_total` the benchmarks tell apart."""

    verb: str
    group: str
    resource: str
    subresource: str
    code: str


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
"""The API server's latency histograms a run reads, and the labels it keeps: how long
requests took to serve, and how long API Priority and Fairness queued them first."""

Histograms = dict[tuple[str, tuple[str, ...]], dict[float, float]]


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


# ============================================================================ /proc


def proc_kib(path: str | Path, keys: tuple[str, ...]) -> dict[str, int]:
    """The `Name:  value kB` lines `keys` names of a /proc file (`/proc/<pid>/status`,
    `/proc/self/smaps_rollup`, `/proc/meminfo`): name → value."""
    out = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in keys:
            out[name] = int(rest.split()[0])
    return out


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
    values = proc_kib(f"/proc/{pid}/status", ("VmRSS", "VmHWM"))
    return ProcSample(ticks / os.sysconf("SC_CLK_TCK"), values["VmRSS"], values["VmHWM"])


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
    """CPU seconds each process (and the machine, `machine busy`) spent between two samples
    of name → CPU seconds, largest first, with `machine cores busy` (busy seconds per second
    of the interval) last; processes in only one sample are left out."""
    spent = {k: round(after[k] - before[k], 1) for k in after if k in before}
    out = dict(sorted(spent.items(), key=lambda kv: -kv[1]))
    if seconds > 0 and "machine busy" in spent:
        out["machine cores busy"] = round(spent["machine busy"] / seconds, 2)
    return out


def load_average(path: Path = Path("/proc/loadavg")) -> str:
    """The 1-, 5- and 15-minute load averages, as /proc writes them."""
    return " ".join(path.read_text().split()[:3])


def sched_autogroup(path: Path = Path("/proc/sys/kernel/sched_autogroup_enabled")) -> bool | None:
    """Whether the kernel shares the cores between sessions (autogroups) rather than
    threads: every component runs in a session of its own, so where it does, a busy operator
    leaves the API server about half the machine (docs/local-cluster.md). None: unknown."""
    try:
        return path.read_text().strip() == "1"
    except OSError:
        return None


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
