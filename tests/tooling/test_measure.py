"""The benchmarks' measurement helpers (benchmarks/measure.py): percentiles, counter deltas,
the API server's counters, and what /proc says about processes and the machine."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from benchmarks import measure
from benchmarks.measure import RequestKey as Key

pytestmark = pytest.mark.tooling


def _line(name: str, value: str, **labels: str) -> str:
    """One sample as kube-apiserver writes it: every label, sorted, in quotes."""
    base = {"component": "apiserver", "dry_run": "", "scope": "resource", "version": "v1"}
    text = ",".join(f'{k}="{v}"' for k, v in sorted({**base, **labels}.items()))
    return f"{name}{{{text}}} {value}"


def _req(value: str, **labels: str) -> str:
    return _line("apiserver_request_total", value, **labels)


EMPTY = {"group": "", "subresource": ""}
METRICS = "\n".join(
    [
        "# HELP apiserver_request_total [STABLE] Counter of apiserver requests broken out ...",
        "# TYPE apiserver_request_total counter",
        _req("12", **EMPTY, code="200", resource="pods", scope="cluster", verb="LIST"),
        _req("30", **EMPTY, code="200", resource="pods", scope="namespace", verb="LIST"),
        _req("7", code="409", group="batch", resource="jobs", subresource="", verb="POST"),
        _req(
            "4.5e+01",
            code="200",
            group="kubetune.io",
            resource="finetunejobs",
            subresource="status",
            verb="PATCH",
            version="v1alpha1",
        ),
        # A non-resource URL has its path as the subresource; a timestamp may follow.
        _req(
            "2 1700000000000",
            code="200",
            group="",
            resource="",
            subresource="openapi/v3",
            verb="GET",
            version="",
        ),
        _req("3", **EMPTY, code="422", component='a\\"b', resource="endpoints", verb="PUT"),
        _line("apiserver_request_duration_seconds_bucket", "99", le="0.005", verb="LIST"),
        _line("apiserver_request_total_other", "5", verb="LIST"),
    ]
)


def test_percentile_interpolates_between_ranks() -> None:
    values = list(range(100, 0, -1))  # 1..100, unsorted
    assert measure.percentile(values, 50) == pytest.approx(50.5)
    assert measure.percentile(values, 99) == pytest.approx(99.01)
    assert measure.percentile(values, 0) == 1
    assert measure.percentile(values, 100) == 100
    assert measure.percentile([7.0], 99) == 7.0
    assert math.isnan(measure.percentile([], 50))
    with pytest.raises(ValueError, match="outside"):
        measure.percentile(values, 101)


def test_nearest_rank_is_always_one_of_the_values() -> None:
    values = [float(v) for v in range(1, 101)]
    assert measure.nearest_rank(values, 50) == 50.0
    assert measure.nearest_rank(values, 99) == 99.0
    assert measure.nearest_rank(values, 100) == 100.0
    assert measure.nearest_rank([1.0, 2.0, 3.0], 50) == 2.0
    assert measure.nearest_rank([1.0, 2.0, 3.0], 0) == 1.0
    assert measure.nearest_rank([7.0], 99) == 7.0


def test_request_totals_are_parsed_and_summed_over_the_labels_not_kept() -> None:
    totals = measure.parse_request_totals(METRICS)
    assert totals == {
        Key("LIST", "", "pods", "", "200"): 42.0,  # cluster- and namespace-scoped lists
        Key("POST", "batch", "jobs", "", "409"): 7.0,
        Key("PATCH", "kubetune.io", "finetunejobs", "status", "200"): 45.0,
        Key("GET", "", "", "openapi/v3", "200"): 2.0,  # a timestamp after the value
        Key("PUT", "", "endpoints", "", "422"): 3.0,  # an escaped quote in another label
    }


def test_closed_watches_are_counted_by_resource_and_between_readings() -> None:
    def closed(value: str, group: str, resource: str) -> str:
        return (
            f'apiserver_terminated_watchers_total{{group="{group}",resource="{resource}"}} {value}'
        )

    before = measure.parse_closed_watchers(
        "\n".join(
            [
                "# TYPE apiserver_terminated_watchers_total counter",
                closed("3", "kubetune.io", "finetunejobs"),
                closed("1", "", "pods"),
                _req("9", **EMPTY, code="200", resource="pods", verb="WATCH"),
            ]
        )
    )
    assert before == {"finetunejobs.kubetune.io": 3.0, "pods": 1.0}
    after = measure.parse_closed_watchers(
        "\n".join(
            [
                closed("31", "kubetune.io", "finetunejobs"),
                closed("1", "", "pods"),
                closed("2 1700000000000", "batch", "jobs"),
            ]
        )
    )
    # Only what grew; a resource first closed in between counts from nothing.
    assert measure.closed_between(before, after) == {
        "finetunejobs.kubetune.io": 28,
        "jobs.batch": 2,
    }
    assert measure.closed_between(after, after) == {}


def test_delta_keeps_what_grew() -> None:
    before = {Key("LIST", "", "pods", "", "200"): 10.0, Key("GET", "", "pods", "", "200"): 5.0}
    after = {
        Key("LIST", "", "pods", "", "200"): 25.0,
        Key("GET", "", "pods", "", "200"): 5.0,
        Key("POST", "batch", "jobs", "", "201"): 3.0,
    }
    assert measure.counter_delta(after, before) == {
        Key("LIST", "", "pods", "", "200"): 15.0,
        Key("POST", "batch", "jobs", "", "201"): 3.0,
    }


def test_histogram_quantile_is_linear_inside_a_bucket() -> None:
    buckets = {0.1: 40.0, 1.0: 70.0, 5.0: 79.0, math.inf: 80.0}
    assert measure.histogram_quantile(buckets, 0.5) == pytest.approx(0.1)  # rank 40 ends it
    assert measure.histogram_quantile(buckets, 0.25) == pytest.approx(0.05)
    assert measure.histogram_quantile({1.0: 1, math.inf: 2}, 0.99) == 1.0  # falls in +Inf
    assert measure.histogram_quantile({}, 0.5) is None
    assert measure.quantiles({1.0: 0.0, math.inf: 0.0}) == {"n": 0, "p50_s": None, "p99_s": None}


def test_proc_files_are_read_by_the_names_of_their_lines(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython3\nVmHWM:\t  20480 kB\nVmRSS:\t  10240 kB\nThreads:\t4\n")
    assert measure.proc_kib(status, ("VmRSS", "VmHWM")) == {"VmRSS": 10240, "VmHWM": 20480}
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.52 0.60 0.70 2/345 6789\n")
    assert measure.load_average(loadavg) == "0.52 0.60 0.70"
    me = measure.proc_sample(os.getpid())
    assert me.cpu_s > 0 and 0 < me.rss_kib <= me.hwm_kib


def test_machine_cpu_counts_every_core_and_leaves_idle_and_iowait_out(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal, in clock ticks
    stat.write_text("cpu  100 20 30 500 50 5 5 0 0 0\ncpu0 50 10 15 250 25 2 3 0 0 0\n")
    busy, total = measure.machine_cpu(stat)
    tick = os.sysconf("SC_CLK_TCK")
    assert (busy, total) == (160 / tick, 710 / tick)


def test_cpu_split_orders_by_spent_and_says_how_many_cores_were_busy() -> None:
    before = {"kube-apiserver": 10.0, "etcd": 2.0, "operator": 5.0, "machine busy": 100.0}
    after = {"kube-apiserver": 40.0, "etcd": 6.5, "benchmark": 3.0, "machine busy": 160.0}
    split = measure.cpu_split(before, after, seconds=40.0)
    # the operator left (absent after), the benchmark came (absent before): both left out
    assert list(split) == ["machine busy", "kube-apiserver", "etcd", "machine cores busy"]
    assert split["kube-apiserver"] == 30.0 and split["etcd"] == 4.5
    assert split["machine cores busy"] == 1.5


def test_other_control_planes_are_counted_by_their_apiserver(tmp_path: Path) -> None:
    def process(pid: str, argv: list[str]) -> None:
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")

    process("41", ["/root/.cache/kubetune/bin/v1/kube-apiserver", "--etcd-servers=x"])
    process("7", ["/usr/bin/python3", "kube-apiserver"])  # the name as an argument only
    process("9", ["/opt/kube-apiserver.d/etcd"])
    process("12", ["kube-apiserver"])
    (tmp_path / "self").mkdir()  # not a pid
    (tmp_path / "13").mkdir()  # a process gone between listing and reading
    assert measure.running_apiservers(tmp_path) == [12, 41]


def test_the_kernels_way_of_sharing_cores_is_read(tmp_path: Path) -> None:
    flag = tmp_path / "sched_autogroup_enabled"
    flag.write_text("1\n")
    assert measure.sched_autogroup(flag) is True
    flag.write_text("0\n")
    assert measure.sched_autogroup(flag) is False
    assert measure.sched_autogroup(tmp_path / "absent") is None
