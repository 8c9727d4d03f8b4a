"""The arithmetic of the operator-scale benchmark (benchmarks/operator_scale/): which API
requests are the operator's, the latencies it reports from its watches and from the API
server's histograms, and the format of its tables, records and report. What it measures
with is tested in test_measure.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks import measure
from benchmarks.operator_scale import accounting, report, scenario, tracker

pytestmark = pytest.mark.tooling

Key = measure.RequestKey
TOTALS = {
    Key("LIST", "", "pods", "", "200"): 42.0,
    Key("POST", "batch", "jobs", "", "409"): 7.0,
    Key("PATCH", "kubetune.io", "finetunejobs", "status", "200"): 45.0,
    Key("GET", "", "", "openapi/v3", "200"): 2.0,
    Key("PUT", "", "endpoints", "", "422"): 3.0,
}
"""API request counts as `measure.parse_request_totals` reads them (test_measure.py)."""


def test_attribution_leaves_out_own_requests_tooling_and_background() -> None:
    window = accounting.Interval(
        delta={
            Key("LIST", "", "pods", "", "200"): 100.0,
            Key("LIST", "", "persistentvolumeclaims", "", "200"): 40.0,  # the provisioner
            Key("POST", "kubetune.io", "finetunejobs", "", "201"): 50.0,
            Key("PATCH", "kubetune.io", "finetunejobs", "status", "200"): 30.0,
            Key("PUT", "coordination.k8s.io", "leases", "", "200"): 200.0,
            Key("PATCH", "events.k8s.io", "events", "", "200"): 70.0,  # the scheduler
        },
        own={("POST", "finetunejobs", ""): 50, ("LIST", "pods", ""): 4},
        seconds=10.0,
    )
    background = accounting.Interval(
        delta={
            Key("PUT", "coordination.k8s.io", "leases", "", "200"): 100.0,
            Key("LIST", "", "persistentvolumes", "", "200"): 20.0,
        },
        own={},
        seconds=5.0,
    )
    assert window.count() == 100 + 50 + 30 + 200 - 54
    assert window.count(accounting.is_list) == 96
    assert window.count(accounting.is_status_write) == 30
    assert background.rate() == 20.0
    # Leases at 20/s in the background: 200 in 10 s are all background.
    assert accounting.beyond_background(window, background) == pytest.approx(326 - 200)
    assert accounting.beyond_background(window, background, accounting.is_list) == 96
    assert accounting.never_the_operators(Key("POST", "events.k8s.io", "events", "", "201"))
    assert not accounting.never_the_operators(Key("POST", "", "events", "", "201"))
    assert accounting.local_tooling(Key("POST", "", "persistentvolumes", "", "409"))
    assert not accounting.local_tooling(Key("POST", "", "persistentvolumeclaims", "", "201"))
    assert not accounting.local_tooling(Key("PUT", "", "persistentvolumes", "status", "200"))
    assert not accounting.heartbeat_free(Key("PUT", "coordination.k8s.io", "leases", "", "200"))
    assert not accounting.heartbeat_free(Key("GET", "", "", "/apis", "200"))
    assert accounting.heartbeat_free(Key("LIST", "", "pods", "", "200"))


def test_batch_job_posts_count_one_answer_code() -> None:
    assert accounting.batch_job_posts(TOTALS, "409") == 7
    assert accounting.batch_job_posts(TOTALS, "201") == 0


def _ftj(
    name: str, created: str, phase: str = "", planned: str | None = None, written: str = ""
) -> dict[str, Any]:
    conditions = []
    if planned is not None:
        conditions.append({"type": "Planned", "status": "True", "lastTransitionTime": planned})
    fields = [{"manager": "benchmark", "operation": "Update", "time": created}]
    if written:
        fields.append({"manager": "kopf", "subresource": "status", "time": written})
    return {
        "metadata": {
            "namespace": "ns",
            "name": name,
            "creationTimestamp": created,
            "managedFields": fields,
        },
        "status": {"phase": phase, "conditions": conditions} if phase else {},
    }


def _pod(
    name: str, job: str, created: str, phase: str, unscheduled: str | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if unscheduled is not None:
        status["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": unscheduled,
            }
        ]
    return {
        "metadata": {
            "namespace": "ns",
            "name": name,
            "creationTimestamp": created,
            "labels": {scenario.LABEL_JOB: job},
        },
        "status": status,
    }


def test_tracker_times_planned_and_first_pod_and_knows_when_settled() -> None:
    t0 = tracker.rfc3339_seconds("2026-01-01T00:00:00Z")
    t = tracker.Tracker(clock=lambda: t0 + 7)
    t.on_job("ADDED", _ftj("a", "2026-01-01T00:00:00Z"))
    at = "2026-01-01T00:00:0{}Z".format
    t.on_job("ADDED", _ftj("b", at(1), "Queued", at(3), written=at(5)))
    t.on_job("MODIFIED", _ftj("a", at(0), "Running", at(2), written=at(6)))
    # A later write keeps the first transition time.
    t.on_job("MODIFIED", _ftj("a", "2026-01-01T00:00:00Z", "Running", "2026-01-01T00:09:00Z"))
    snap = t.snapshot(t0 + 10, patience=100)
    assert (snap.planned, snap.running_without_pods) == (2, 1)
    assert not snap.settled(2), "a Running job without pods is not settled"
    t.on_pod("ADDED", _pod("a-0", "a", "2026-01-01T00:00:05Z", "Pending"))
    snap = t.snapshot(t0 + 10, patience=100)
    assert (snap.pending_pods, snap.young_pending_pods, snap.running_without_pods) == (1, 1, 0)
    assert not snap.settled(2), "the operator may still move a young Pending pod"
    old = t.snapshot(t0 + 200, patience=100)
    assert (old.pending_pods, old.young_pending_pods) == (1, 0)
    assert old.settled(2), "a pod Pending longer than the operator waits found no place"
    unbound = "0/200 nodes are available: pod has unbound immediate PersistentVolumeClaims."
    t.on_pod("MODIFIED", _pod("a-0", "a", "2026-01-01T00:00:05Z", "Pending", unbound))
    binding = t.snapshot(t0 + 200, patience=100)
    assert binding.volume_pending_pods == 1
    assert not binding.settled(2), "a pod waiting for its volume claims to bind will still run"
    full = "0/200 nodes are available: 200 Insufficient nvidia.com/gpu."
    t.on_pod("MODIFIED", _pod("a-0", "a", "2026-01-01T00:00:05Z", "Pending", full))
    placed = t.snapshot(t0 + 200, patience=100)
    assert placed.settled(2)
    assert placed.pending_reasons == {"N/N nodes are available: N Insufficient nvidia.com/gpu.": 1}
    t.on_pod("ADDED", _pod("a-1", "a", "2026-01-01T00:00:04Z", "Running"))
    t.on_pod("DELETED", _pod("a-0", "a", "2026-01-01T00:00:05Z", "Pending"))
    snap = t.snapshot(t0 + 10, patience=100)
    assert snap.settled(2) and not snap.settled(3)
    assert snap.phases == {"Running": 1, "Queued": 1}
    assert (snap.pending_pods, snap.running_pods) == (0, 1)
    # The operator's part ends at the first batch Job; a later attempt's does not count.
    batch_job = {"metadata": {**_pod("a-a1", "a", "2026-01-01T00:00:03Z", "")["metadata"]}}
    t.on_batch_job("ADDED", batch_job)
    later = {"metadata": {**_pod("a-a2", "a", "2026-01-01T00:05:00Z", "")["metadata"]}}
    t.on_batch_job("ADDED", later)
    created, planned, first_batch_job, first_pod, queued, seen, written = t.timings()
    assert tracker.latencies(created, seen) == [7.0, 6.0], "seen when the watch delivered it"
    assert tracker.latencies(created, written) == [6.0, 4.0], "the status write that carried it"
    assert queued == {("ns", "b")}, "b was seen Queued; a never was"
    assert t.first_queued() == {"": 1}
    assert tracker.latencies(created, planned) == [2.0, 2.0]
    assert tracker.latencies(created, first_pod) == [4.0]
    assert tracker.latencies(created, first_batch_job) == [3.0]
    assert tracker.latencies(first_batch_job, first_pod) == [1.0]


def test_status_writes_are_counted_by_what_they_changed_while_asked() -> None:
    planned = {"type": "Planned", "status": "True", "lastTransitionTime": "2026-01-01T00:00:01Z"}
    queued = {"type": "Queued", "status": "True", "message": "position 3 in the queue"}
    old = {"phase": "Queued", "message": "position 3 in the queue", "conditions": [planned, queued]}
    moved = {**queued, "message": "position 2 in the queue"}
    new = {"phase": "Queued", "message": "position 2 in the queue", "conditions": [planned, moved]}
    assert tracker.status_changes(old, new) == "Queued: message, conditions[Queued]"
    assert tracker.status_changes(old, {**old, "cost": {"usd": 1}}) == "Queued: cost"

    t = tracker.Tracker()
    job = {
        "metadata": {"namespace": "ns", "name": "a", "creationTimestamp": "2026-01-01T00:00:00Z"}
    }
    t.on_job("ADDED", {**job, "status": old})
    t.on_job("MODIFIED", {**job, "status": new})
    assert not t.writes, "counted only while the steady window asks"
    t.steady_seen = t.counting_writes = True  # as the steady window sets them
    t.on_job("MODIFIED", {**job, "status": old})
    t.on_job("MODIFIED", {**job, "status": old})  # no change: not a write the watch shows
    assert t.writes == {"Queued: message, conditions[Queued]": 1}
    assert t.moves == {"back a tenth or more": 1}, "position 2 → 3"
    # Before the steady window the same writes go to the burst's count, moves told apart;
    # once it began, none does.
    assert t.burst_writes == {
        "Queued: message, conditions[Queued]; position forward a tenth or more": 1
    }
    t.counting_writes = False
    t.on_job("MODIFIED", {**job, "status": {**old, "cost": {"usd": 2}}})
    assert sum(t.burst_writes.values()) == 1 and t.writes.total() == 1


def test_position_moves_are_told_by_direction_and_how_far() -> None:
    def at(position: int) -> dict[str, str]:
        return {"message": f"position {position} in the queue of pool a100: waiting"}

    assert tracker.position_move(at(200), at(199)) == "forward less than a tenth"
    assert tracker.position_move(at(200), at(180)) == "forward a tenth or more"
    assert tracker.position_move(at(200), at(201)) == "back less than a tenth"
    assert tracker.position_move(at(2), at(1)) == "forward a tenth or more"
    assert tracker.position_move(at(7), at(7)) == "unmoved"
    assert tracker.position_move(at(7), {"message": "launched"}) is None


ROW_RECORD: dict[str, Any] = {
    "date": "2026-01-01",
    "time": "10:00",
    "label": "before",
    "commit": "abc1234",
    "pools": "4×50×8",
    "namespaces": 20,
    "clients": 32,
    "jobs": 200,
    "not_planned": 0,
    "plan_p50_s": 2.0,
    "plan_p99_s": math.nan,
    "pod_p50_s": 4.0,
    "pod_p99_s": 9.0,
    "planned_per_s": 12.5,
    "to_steady_s": 300.0,
    "steady": False,
    "phases": {"Running": 150, "Queued": 50},
    "pending_pods": 6,
    "rss_peak_mib": 120.0,
    "cpu_pct": 35.0,
    "requests_per_job": 80.0,
    "list_per_s": 60.0,
    "req_per_running_job_per_s": 0.4,
    "status_writes_per_running_job_per_min": 6.0,
    "job_post_409": 200,
    "load_start": "1.0 1.0 1.0",
    "load_end": "3.0 2.0 1.0",
}


def test_every_results_row_fills_every_column() -> None:
    result = ROW_RECORD
    header = report.table_header().splitlines()[0]
    row = report.table_row(result)
    assert row.count("|") == header.count("|")
    assert "| 2 / – |" in row  # a NaN percentile shows as a dash
    assert "300 (not steady)" in row
    assert "| 150 / 50 (6 pods Pending) |" in row
    assert "| – / – | 4 / 9 |" in row, "rows from before the batch Job column show dashes"
    tuned = report.table_row({**result, "client_qps": 100, "bin_packing": True})
    assert "4×50×8, 20, 32; controller-manager and scheduler QPS 100; GPU bin packing |" in tuned
    assert "other control plane" not in row
    shared = report.table_row({**result, "other_apiservers": 1})
    assert "| 1.0 1.0 1.0 → 3.0 2.0 1.0; 1 other control plane(s) running |" in shared


def test_breakdown_keys_read_back() -> None:
    rows = accounting.breakdown(TOTALS)
    assert {accounting.parse_breakdown_key(k): v for k, v in rows.items()} == TOTALS


def _record(**over: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "jobs": 10,
        "running_jobs": 5.0,
        "to_steady_s": 100.0,
        "window_s": 10.0,
        "background_s": 5.0,
        "requests_create_to_steady": {
            "POST kubetune.io/finetunejobs 201": 10,
            "LIST core/pods 200": 300,
            "PUT coordination.k8s.io/leases 200": 2000,
            "POST core/persistentvolumes 409": 500,
        },
        "requests_steady_window": {
            "LIST core/pods 200": 50,
            "PATCH kubetune.io/finetunejobs/status 200": 5,
            "PUT coordination.k8s.io/leases 200": 200,
            "PATCH events.k8s.io/events 200": 40,
        },
        "requests_background_window": {"PUT coordination.k8s.io/leases 200": 100},
        "own_requests": {
            "create_to_steady": {"POST finetunejobs": 10},
            "steady_window": {},
            "background_window": {},
        },
    }
    return {**record, **over}


def test_request_columns_come_from_the_stored_counts() -> None:
    cols = accounting.request_columns(_record())
    assert cols["background_per_s"] == 20.0  # kwok's Leases
    assert cols["requests_per_job"] == pytest.approx((300 + 2000 - 20 * 100) / 10)
    assert cols["list_per_s"] == 5.0
    assert cols["req_per_running_job_per_s"] == pytest.approx(55 / 5 / 10)
    assert cols["status_writes_per_running_job_per_min"] == pytest.approx(6.0)
    # Older lines kept one total of the benchmark's own requests: all of it counts as creates.
    flat = accounting.request_columns(_record(own_requests={"POST finetunejobs": 10}))
    assert flat == cols


def test_rescore_rewrites_the_rows_and_keeps_what_is_above_the_table(tmp_path: Path) -> None:
    base = {
        "date": "2026-01-01",
        "time": "10:00",
        "label": "x",
        "commit": "abc",
        "pools": "4×50×8",
        "namespaces": 20,
        "clients": 32,
        "not_planned": 0,
        "plan_p50_s": 1.0,
        "plan_p99_s": 2.0,
        "pod_p50_s": 3.0,
        "pod_p99_s": 4.0,
        "planned_per_s": 5.0,
        "steady": True,
        "phases": {"Running": 5},
        "pending_pods": 0,
        "rss_peak_mib": 100.0,
        "cpu_pct": 10.0,
        "job_post_409": 0,
        "load_start": "1 1 1",
        "load_end": "1 1 1",
        "requests_per_job": 999.0,
    }
    jsonl = tmp_path / "operator-scale-2026-01-01.jsonl"
    jsonl.write_text(json.dumps(_record(**base)) + "\n")
    md = jsonl.with_suffix(".md")
    md.write_text("# title\n\nA note.\n\n" + report.table_header() + "| stale row |\n")
    [record] = report.rescore(jsonl)
    assert record["requests_per_job"] == pytest.approx(30.0)
    assert json.loads(jsonl.read_text())["requests_per_job"] == pytest.approx(30.0)
    text = md.read_text()
    assert text.startswith("# title\n\nA note.\n\n" + report.table_header())
    assert "stale row" not in text and "| 30.0 |" in text


def _buckets(name: str, counts: dict[str, int], **labels: str) -> list[str]:
    """A histogram's bucket samples, one per upper bound."""
    out = []
    for le, n in counts.items():
        text = ",".join(f'{k}="{v}"' for k, v in {**labels, "le": le}.items())
        out.append(f"{name}_bucket{{{text}}} {n}")
    return out


def test_api_server_latency_between_two_scrapes() -> None:
    served = "apiserver_request_duration_seconds"
    status = {"verb": "PATCH", "resource": "finetunejobs", "subresource": "status"}
    before = measure.parse_histograms(
        "\n".join(
            [
                *_buckets(served, {"0.1": 10, "1": 10, "5": 10, "+Inf": 10}, **status, scope="a"),
                'apiserver_request_total{verb="GET"} 3',
                "# HELP x",
            ]
        )
    )
    # 100 more writes: 50 under 0.1 s, 40 more under 1 s, 9 under 5 s, 1 beyond; counted
    # under two scopes that the summary adds up
    after = measure.parse_histograms(
        "\n".join(
            _buckets(served, {"0.1": 40, "1": 70, "5": 79, "+Inf": 80}, **status, scope="a")
            + _buckets(served, {"0.1": 20, "1": 30, "5": 30, "+Inf": 30}, **status, scope="b")
            + _buckets(
                "apiserver_flowcontrol_request_wait_duration_seconds",
                {"0.5": 1, "2": 3, "+Inf": 4},
                priority_level="workload-low",
                execute="true",
            )
        )
    )
    summary = accounting.latency_summary(before, after)
    patch = summary["PATCH finetunejobs/status"]
    assert patch["n"] == 100
    assert patch["p50_s"] == 0.1  # rank 50 is the last of the first bucket
    assert patch["p99_s"] == 5.0  # rank 99 ends the 5 s bucket
    assert summary["POST jobs"] == {"n": 0, "p50_s": None, "p99_s": None}
    assert summary["APF wait workload-low"] == {"n": 4, "p50_s": 1.25, "p99_s": 2.0}
    assert measure.histogram_quantile({1.0: 1, math.inf: 2}, 0.99) == 1.0  # falls in +Inf


def test_the_operators_split_is_read_from_its_own_exposition() -> None:
    from prometheus_client import generate_latest

    from kubetune.controller.metrics import OperatorMetrics

    m = OperatorMetrics(runtime=False)
    created = "2025-01-01T00:00:00Z"
    for late in (1.0, 2.0, 3.0, 12.0):  # creation → loop started, Unix time of creation + late
        m.loop_started(created, now=1735689600.0 + late)
    m.reconcile_wait.observe(0.02)
    view = accounting.operator_view(generate_latest(m.registry).decode())
    loop = view["kubetune_finetunejob_time_to_loop_seconds"]
    assert loop["n"] == 4
    assert loop["p50_s"] == 2.5  # rank 2 ends the 2.5 s bucket (1.0 and 2.0 in it)
    assert 10.0 < loop["p99_s"] <= 15.0  # the 12 s job, inside the 10-15 s bucket
    assert view["kubetune_reconcile_wait_seconds"]["n"] == 1
    assert view["kubetune_finetunejob_time_to_plan_seconds"] == {
        "n": 0,
        "p50_s": None,
        "p99_s": None,
    }


def test_first_seen_reads_the_independent_watchs_file(tmp_path: Path) -> None:
    out = tmp_path / "first-events.jsonl"
    out.write_text(
        '{"synced": true}\n{"job": "scale-00/ftj-00001", "at": 12.5}\n'
        '{"job": "scale-01/ftj-00002", "at": 14.0}\n'
    )
    seen = tracker.first_seen(out)
    assert seen == {("scale-00", "ftj-00001"): 12.5, ("scale-01", "ftj-00002"): 14.0}
    created = {("scale-00", "ftj-00001"): 10.0, ("scale-02", "ftj-00003"): 11.0}
    assert tracker.latencies(created, seen) == [2.5]  # only jobs the run created and the watch saw


def test_planned_is_split_job_by_job_at_the_independent_watchs_first_sight() -> None:
    delivered = {("a", "1"): 12.5, ("a", "2"): 14.2, ("b", "3"): 20.0, ("b", "4"): 30.0}
    # the Planned condition's time is truncated to the second: job 2 was decided within the
    # second it was delivered; job 4 was never Planned; job 5 never seen by the watch
    planned = {("a", "1"): 15.0, ("a", "2"): 14.0, ("b", "3"): 28.0, ("c", "5"): 9.0}
    split = tracker.after_delivery(delivered, planned)
    assert split["plan_after_delivery_n"] == 3
    assert split["plan_after_delivery_p50_s"] == pytest.approx(2.5)
    assert split["plan_after_delivery_p99_s"] == pytest.approx(7.89)
    assert tracker.after_delivery(delivered, {}) == {}
    record = {**ROW_RECORD, **split}
    assert "(after delivery 2 / 8) |" in report.table_row(record)
    assert "(negative: before it; 1 s resolution) p50 2.5s p99 7.9s (3 jobs)" in (
        report.after_delivery_text(record)
    )


DELIVERY_RECORD: dict[str, Any] = {
    "date": "2026-11-29",
    "time": "00:30",
    "label": "no operator",
    "commit": "abc1234",
    "jobs": 1000,
    "clients": 32,
    "create_s": 40.0,
    "delivered_p50_s": 1.5,
    "delivered_p99_s": 3.3,
    "delivered_max_s": 4.0,
    "cpu_s_creation": {
        "machine busy": 70.0,
        "kube-apiserver": 40.0,
        "etcd": 9.0,
        "machine cores busy": 1.75,
    },
    "load_start": "0.1 0.2 0.3",
    "load_end": "1.0 1.1 1.2",
}


def test_delivery_results_start_a_table_and_append_rows(tmp_path: Path) -> None:
    record = DELIVERY_RECORD
    path = tmp_path / "apiserver-delivery-2026-11-29.md"
    report.write_delivery_results(path, record)
    report.write_delivery_results(path, {**record, "time": "00:40"})
    lines = path.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| time"))
    rows = lines[header + 2 :]
    assert [row.split(" | ")[0] for row in rows] == ["| 2026-11-29 00:30", "| 2026-11-29 00:40"]
    assert "| 1.5 / 3.3 / 4.0 |" in rows[0]
    assert "kube-apiserver 40.0, etcd 9.0 (1.75 of" in rows[0]
    assert all(len(row.split(" | ")) == len(report.DELIVERY_COLUMNS) for row in rows)
    jsonl = path.with_suffix(".jsonl").read_text().splitlines()
    assert [json.loads(line)["time"] for line in jsonl] == ["00:30", "00:40"]


FLOOR_RECORD = {
    **DELIVERY_RECORD,
    "label": "floor",
    "mode": "planned floor",
    "plan_p50_s": 1.0,
    "plan_p99_s": 3.0,
    "plan_max_s": 4.0,
    "plan_written_p50_s": 2.0,
    "plan_written_p99_s": 5.0,
    "plan_seen_p50_s": 2.4,
    "plan_seen_p99_s": 6.1,
}
"""A `--planned-floor` run's record as `write_delivery_results` takes it."""


def test_planned_floor_results_have_columns_of_their_own(tmp_path: Path) -> None:
    record = {**FLOOR_RECORD, "cpu_s_creation": {"kube-apiserver": 20.0, "minimal writer": 3.0}}
    path = tmp_path / "planned-floor-2026-11-29.md"
    report.write_delivery_results(path, record)
    text = path.read_text()
    assert text.startswith("# Creation → Planned with the least an operator can do")
    row = text.splitlines()[-1]
    assert len(row.split(" | ")) == len(report.FLOOR_COLUMNS)
    assert "| 1 / 3 / 4 | 2 / 5 | 2.4 / 6.1 |" in row
    assert "minimal writer 3.0" in row
    assert "Planned by the minimal writer p50 1s p99 3s max 4s" in report.delivery_report(
        {**record, "create_outcomes": {"201": 1000}, "all_seen_s": 9.0, "cpu_s_to_all_seen": {}}
    )


def test_launch_latencies_run_from_creation_and_from_the_batch_job() -> None:
    a, b, c = ("ns", "a"), ("ns", "b"), ("ns", "c")
    timings = tracker.Timings(
        created={a: 100.0, b: 100.0, c: 100.0},
        planned={},
        first_batch_job={a: 103.0, b: 105.0},
        first_pod={a: 110.0},
        queued=frozenset(),
        planned_seen={},
        planned_written={},
    )
    got = tracker.launch_latencies(timings)
    assert got["batch_job_p50_s"] == 4.0 and got["batch_job_p99_s"] == pytest.approx(4.98)
    assert got["pod_p50_s"] == got["pod_p99_s"] == 10.0
    assert got["pod_after_batch_job_p50_s"] == 7.0
    none = tracker.launch_latencies(timings._replace(first_batch_job={}, first_pod={}))
    assert none.keys() == got.keys() and all(math.isnan(v) for v in none.values())


def test_a_floor_run_that_launched_shows_its_pods_in_the_table(tmp_path: Path) -> None:
    record = {
        **FLOOR_RECORD,
        "label": "floor with launches",
        "launched": 250,
        "batch_job_p50_s": 6.0,
        "batch_job_p99_s": 8.0,
        "pod_p50_s": 12.0,
        "pod_p99_s": 19.0,
        "pod_after_batch_job_p50_s": 6.0,
        "pod_after_batch_job_p99_s": 11.0,
    }
    path = tmp_path / "planned-floor-2026-11-30.md"
    report.write_delivery_results(path, {**record, "launched": 0})
    report.write_delivery_results(path, {**record, "floor_writers": 32})
    text = path.read_text()
    assert "--floor-launches N" in text
    without, launched = text.splitlines()[-2:]
    assert all(len(row.split(" | ")) == len(report.FLOOR_COLUMNS) for row in (without, launched))
    assert "| 8, 0 | – | – |" in without  # rows from before --floor-writers had 8
    assert "| 32, 250 | 6 / 8 | 12 / 19 (6 / 11) |" in launched
    told = report.delivery_report(
        {**record, "create_outcomes": {"201": 1000}, "all_seen_s": 9.0, "cpu_s_to_all_seen": {}}
    )
    assert "250 jobs launched by the minimal writer" in told
    assert "→ batch Job p50 / p99 6 / 8s, → first pod 12 / 19s; batch Job → first pod 6 / 11s" in (
        told
    )


def test_the_kernels_way_of_sharing_cores_is_told() -> None:
    assert "between sessions" in report.sharing({"sched_autogroup": True})
    assert "between threads" in report.sharing({"sched_autogroup": False})
    assert "not recorded" in report.sharing({})
