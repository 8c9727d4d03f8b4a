"""What a run prints and keeps: a row of the dated results table (its columns are what
docs/local-cluster.md#the-operator-at-scale explains), the record as a JSON line beside it,
and the report on the terminal; the floors' tables; and the rescoring of stored runs."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.operator_scale.accounting import OPERATOR_VIEW_NAMES, request_columns
from benchmarks.operator_scale.floor import PLANNED_FLOOR_WRITERS


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def sharing(record: Mapping[str, Any]) -> str:
    """How the kernel shared the cores in a run (`sched_autogroup`), in words."""
    autogroup = record.get("sched_autogroup")
    if autogroup is None:
        return "how the kernel shared the cores between processes: not recorded"
    if autogroup:
        return "the kernel shared the cores between sessions (autogroup), each component one"
    return "the kernel shared the cores between threads (no autogroup)"


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
        "Made by `python -m benchmarks.operator_scale --jobs N --label LABEL`, one row per run "
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
            f"Made by `python -m benchmarks.operator_scale {flag}`: the local control plane, "
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
