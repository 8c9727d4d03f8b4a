"""Grafana dashboards as code (grafana-foundation-sdk) → charts/kubetune/dashboards/*.json.

    python hack/gen_dashboards.py           # write the JSON files
    python hack/gen_dashboards.py --check   # exit 1 when the committed files differ

Two dashboards, both with a templated Prometheus datasource and a `namespace` variable:

* "kubetune / Jobs overview": phases, queue, GPUs in use by pool, cost, failures,
  recoveries, estimator error, operator health (reconcile p50/p95/p99, errors).
* "kubetune / Training run": one job (`finetunejob` variable): loss and eval loss,
  DPO reward accuracy and margin (train and eval), tokens/s against the plan, MFU, GPU
  memory estimated against the trainer's peak and the GPU's capacity, GPU utilisation and
  memory per GPU (DCGM exporter) and pod memory (cAdvisor), progress and ETA, cost against
  estimate and budget, checkpoints, restarts.

Both mark recoveries (and the run, checkpoints) with annotations, give every number a unit,
and link to each other; the overview's tables have one row per job, the job's name linking
to its Training run.

Operator series (`kubetune_*`) carry `namespace` and `finetunejob` labels; trainer series
(`kubetune_trainer_*`) get the same labels from the chart's PodMonitor. docs/observability.md
describes every panel; tests/unit/test_chart.py checks the committed JSON matches this
script and that every query uses only metrics kubetune exports.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import BigValueTextMode, GraphDrawStyle
from grafana_foundation_sdk.models.dashboard import (
    DashboardLinkType,
    DataSourceRef,
    DataTransformerConfig,
    DynamicConfigValue,
    Threshold,
    ThresholdsMode,
    VariableHide,
    VariableRefresh,
    VariableSort,
)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "charts/kubetune/dashboards"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
NS = 'namespace=~"$namespace"'
JOB = 'namespace="$namespace", finetunejob="$finetunejob"'
RATE = "$__rate_interval"
OVERVIEW_UID = "kubetune-jobs-overview"
RUN_UID = "kubetune-training-run"
# The trainer pods of a job, every rank and attempt: the Indexed Job `<job>-a<attempt>` names
# them `<job>-a<attempt>-<index>-<random>` (control/build/names.py child_names); the random
# suffix has no dash, so another job's pods never match.
PODS = 'namespace="$namespace", pod=~"$finetunejob-a[0-9]+-[0-9]+-[a-z0-9]+"'
EXTERNAL = {
    "DCGM_FI_DEV_GPU_UTIL": "DCGM exporter",
    "DCGM_FI_DEV_FB_USED": "DCGM exporter",
    "container_memory_working_set_bytes": "cAdvisor (the kubelet)",
}
"""Metrics of other exporters that some panels use: their descriptions name the exporter,
and they show "No data" where it is not installed."""


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False


def _target(q: Query, ref: str) -> Dataquery:
    target = Dataquery().expr(q.expr).ref_id(ref).datasource(DS)
    if q.legend:
        target = target.legend_format(q.legend)
    if q.instant:
        target = target.instant().format("table")
    return target


def _with_targets(panel: Any, queries: list[Query]) -> Any:
    for i, q in enumerate(queries):
        panel = panel.with_target(_target(q, chr(ord("A") + i)))
    return panel


Override = tuple[str, list[DynamicConfigValue]]
"""(refId of a query, the field settings that differ for its series)."""


def ts(
    title: str,
    description: str,
    unit: str,
    *queries: Query,
    span: int = 12,
    height: int = 8,
    overrides: list[Override] | None = None,
    bounds: tuple[float, float] | None = None,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DS)
        .span(span)
        .height(height)
        .draw_style(GraphDrawStyle.LINE)
        .fill_opacity(10)
    )
    if bounds is not None:
        panel = panel.min(bounds[0]).max(bounds[1])
    for ref, properties in overrides or []:
        panel = panel.override_by_query(ref, properties)
    return _with_targets(panel, list(queries))


def ceiling_line() -> list[DynamicConfigValue]:
    """A limit drawn as a dashed red line without fill."""
    return [
        DynamicConfigValue("color", {"mode": "fixed", "fixedColor": "red"}),
        DynamicConfigValue("custom.lineStyle", {"fill": "dash", "dash": [10, 10]}),
        DynamicConfigValue("custom.fillOpacity", 0),
    ]


def right_axis(unit: str) -> list[DynamicConfigValue]:
    return [DynamicConfigValue("unit", unit), DynamicConfigValue("custom.axisPlacement", "right")]


def single(
    title: str,
    description: str,
    unit: str,
    query: Query,
    *,
    span: int = 4,
    text_mode: BigValueTextMode = BigValueTextMode.VALUE,
    thresholds: list[tuple[float | None, str]] | None = None,
) -> stat.Panel:
    steps = thresholds or [(None, "green")]
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DS)
        .span(span)
        .height(4)
        .text_mode(text_mode)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(
            ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps([Threshold(value=v, color=c) for v, c in steps])
        )
    )
    return _with_targets(panel, [query])


def tab(
    title: str,
    description: str,
    columns: dict[str, Query],
    *,
    unit: str,
    units: dict[str, str] | None = None,
    hide: tuple[str, ...] = (),
    span: int = 24,
) -> table.Panel:
    """One row per job: each query is an instant query in table format, one value column per
    query (named by the keys of `columns`), merged on their labels."""
    panel = (
        table.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .span(span)
        .height(8)
        .unit(unit)
        .show_header(True)
    )
    names = list(columns)
    # One query gives a column `Value`, several give `Value #A`, `Value #B`, ...
    values = (
        {"Value": names[0]}
        if len(names) == 1
        else {f"Value #{chr(ord('A') + i)}": n for i, n in enumerate(names)}
    )
    excluded = {"Time": True, **{v: True for v, n in values.items() if n in hide}}
    renamed = {v: n for v, n in values.items() if n not in hide}
    # Organize orders and renames by the fields' names before renaming.
    order = ["namespace", "finetunejob", *renamed]
    panel = (
        panel.with_transformation(DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": excluded,
                    "renameByName": renamed,
                    "indexByName": {n: i for i, n in enumerate(order)},
                },
            )
        )
        .override_by_name("finetunejob", [job_link()])
    )
    for name, column_unit in (units or {}).items():
        panel = panel.override_by_name(name, [DynamicConfigValue("unit", column_unit)])
    return _with_targets(panel, [Query(q.expr, instant=True) for q in columns.values()])


def job_link() -> DynamicConfigValue:
    """A data link from a job's name to the Training run dashboard, same data source and
    time range."""
    url = (
        f"/d/{RUN_UID}/kubetune-training-run?${{datasource:queryparam}}"
        "&var-namespace=${__data.fields.namespace}&var-finetunejob=${__value.raw}"
        "&${__url_time_range}"
    )
    return DynamicConfigValue("links", [{"title": "Training run of ${__value.raw}", "url": url}])


def other_dashboards() -> DashboardLink:
    """The other kubetune dashboards, in the top bar, with this time range and variables."""
    return (
        DashboardLink("kubetune")
        .type(DashboardLinkType.DASHBOARDS)
        .tags(["kubetune"])
        .as_dropdown(False)
        .keep_time(True)
        .include_vars(True)
    )


def annotation(name: str, color: str, expr: str, title: str, tags: str) -> dict[str, Any]:
    """A Prometheus annotation: a marker wherever `expr` (`changes(...) > 0` over 2m,
    evaluated every minute, so no change falls between two windows) has a value."""
    return {
        "datasource": {"type": DS.type_val, "uid": DS.uid},
        "enable": True,
        "hide": False,
        "iconColor": color,
        "name": name,
        "expr": expr,
        "step": "1m",
        "titleFormat": title,
        "textFormat": "",
        "tagKeys": tags,
        "useValueForTime": False,
    }


def builtin_annotation() -> dict[str, Any]:
    """Grafana's own annotations and alerts, as a new dashboard has them."""
    return {
        "builtIn": 1,
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard",
    }


def recoveries_annotation(selector: str, title: str) -> dict[str, Any]:
    return annotation(
        "Recoveries",
        "red",
        "sum by (namespace, finetunejob, reason) "
        f"(changes(kubetune_finetunejob_recoveries_total{{{selector}}}[2m])) > 0",
        title,
        "reason",
    )


def checkpoints_annotation() -> dict[str, Any]:
    return annotation(
        "Checkpoints",
        "blue",
        f"changes(kubetune_finetunejob_checkpoint_step{{{JOB}}}[2m]) > 0",
        "Checkpoint written",
        "finetunejob",
    )


def datasource_var() -> DatasourceVariable:
    return DatasourceVariable("datasource").label("Data source").type("prometheus")


def namespace_var(multi: bool) -> QueryVariable:
    var = (
        QueryVariable("namespace")
        .label("Namespace")
        .datasource(DS)
        .query("label_values(kubetune_finetunejob_info, namespace)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )
    if multi:
        var = var.multi(True).include_all(True).all_value(".*")
    return var


# --------------------------------------------------------------------------- overview


def _per_job(metric: str, agg: str = "sum") -> str:
    """One series per job, without the scrape's `job`/`instance` labels (table columns)."""
    return f"{agg} by (namespace, finetunejob) ({metric}{{{NS}}})"


def jobs_overview() -> Dashboard:
    running_gpus = (
        f"kubetune_finetunejob_gpus{{{NS}}} * on (namespace, finetunejob) group_left () "
        'kubetune_finetunejob_info{phase="Running"}'
    )
    zero_per_handler = (
        f"sum by (handler) (rate(kubetune_reconcile_duration_seconds_count[{RATE}])) * 0"
    )
    return (
        Dashboard("kubetune / Jobs overview")
        .uid(OVERVIEW_UID)
        .description("FineTuneJobs across namespaces: phases, queue, GPUs, cost, recoveries.")
        .tags(["kubetune"])
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .links([other_dashboards()])
        .with_variable(datasource_var())
        .with_variable(namespace_var(multi=True))
        .with_row(Row("Jobs"))
        .with_panel(
            single(
                "Running",
                "FineTuneJobs in phase Running.",
                "short",
                Query(f'count(kubetune_finetunejob_info{{{NS}, phase="Running"}}) or vector(0)'),
            )
        )
        .with_panel(
            single(
                "Queued",
                "FineTuneJobs waiting for free GPUs on an allowed pool.",
                "short",
                Query(f'count(kubetune_finetunejob_info{{{NS}, phase="Queued"}}) or vector(0)'),
                thresholds=[(None, "green"), (1, "orange")],
            )
        )
        .with_panel(
            single(
                "Failed",
                "FineTuneJobs in phase Failed (still present in the cluster).",
                "short",
                Query(f'count(kubetune_finetunejob_info{{{NS}, phase="Failed"}}) or vector(0)'),
                thresholds=[(None, "green"), (1, "red")],
            )
        )
        .with_panel(
            single(
                "GPUs in use",
                "GPUs planned for Running jobs.",
                "short",
                Query(f"sum({running_gpus}) or vector(0)"),
            )
        )
        .with_panel(
            single(
                "Spend rate",
                "What the Running jobs cost per hour now.",
                "currencyUSD",
                Query(
                    f"sum(kubetune_finetunejob_cost_rate_usd_per_hour{{{NS}}} "
                    "* on (namespace, finetunejob) group_left () "
                    'kubetune_finetunejob_info{phase="Running"}) or vector(0)'
                ),
            )
        )
        .with_panel(
            single(
                "Accrued cost",
                "Cost accrued by the jobs present in the cluster.",
                "currencyUSD",
                Query(f"sum(kubetune_finetunejob_accrued_cost_usd{{{NS}}}) or vector(0)"),
            )
        )
        .with_panel(
            ts(
                "Jobs by phase",
                "How many FineTuneJobs are in each phase.",
                "short",
                Query(f"count by (phase) (kubetune_finetunejob_info{{{NS}}})", "{{phase}}"),
            )
        )
        .with_panel(
            ts(
                "Queue wait",
                "Time jobs spent Queued before capacity freed up (p50, p95), by pool.",
                "s",
                Query(
                    "histogram_quantile(0.5, sum by (le, pool) "
                    f"(rate(kubetune_finetunejob_queue_wait_seconds_bucket[{RATE}])))",
                    "p50 {{pool}}",
                ),
                Query(
                    "histogram_quantile(0.95, sum by (le, pool) "
                    f"(rate(kubetune_finetunejob_queue_wait_seconds_bucket[{RATE}])))",
                    "p95 {{pool}}",
                ),
            )
        )
        .with_panel(
            tab(
                "Jobs",
                "One row per FineTuneJob: phase and plan. A job's name opens its Training run "
                "dashboard.",
                {
                    "info": Query(
                        "sum by (namespace, finetunejob, phase, pool, method, gpu_product, spot) "
                        f"(kubetune_finetunejob_info{{{NS}}})"
                    )
                },
                unit="none",
                hide=("info",),
            )
        )
        .with_row(Row("GPUs and capacity"))
        .with_panel(
            ts(
                "GPUs in use by pool",
                "GPUs planned for Running jobs, stacked by pool.",
                "short",
                Query(f"sum by (pool) ({running_gpus})", "{{pool}}"),
            )
        )
        .with_panel(
            ts(
                "Free and allocatable GPUs by pool",
                "From live Nodes: allocatable nvidia.com/gpu and what running pods leave free.",
                "short",
                Query("sum by (pool) (kubetune_gpupool_free_gpus)", "free {{pool}}"),
                Query("sum by (pool) (kubetune_gpupool_allocatable_gpus)", "allocatable {{pool}}"),
            )
        )
        .with_panel(
            ts(
                "Time to plan and time to running",
                "From a job's creation to its first plan, and to phase Running (p50, p95).",
                "s",
                Query(
                    "histogram_quantile(0.95, sum by (le) "
                    f"(rate(kubetune_finetunejob_time_to_plan_seconds_bucket[{RATE}])))",
                    "plan p95",
                ),
                Query(
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(kubetune_finetunejob_time_to_running_seconds_bucket[{RATE}])))",
                    "running p50",
                ),
                Query(
                    "histogram_quantile(0.95, sum by (le) "
                    f"(rate(kubetune_finetunejob_time_to_running_seconds_bucket[{RATE}])))",
                    "running p95",
                ),
            )
        )
        .with_panel(
            ts(
                "Plans by pool and method",
                "Plans made in the last hour (first plans and re-plans).",
                "short",
                Query(
                    "sum by (pool, method) (increase(kubetune_plans_total[1h]))",
                    "{{pool}} {{method}}",
                ),
            )
        )
        .with_row(Row("Cost"))
        .with_panel(
            ts(
                "Accrued cost by namespace",
                "Cost accrued by the jobs present, per namespace.",
                "currencyUSD",
                Query(
                    f"sum by (namespace) (kubetune_finetunejob_accrued_cost_usd{{{NS}}})",
                    "{{namespace}}",
                ),
            )
        )
        .with_panel(
            tab(
                "Cost per job: accrued, estimated, budget",
                "One row per job: accrued against the plan's estimate and "
                "spec.resources.maxCostUSD (empty without a budget), and the share of the "
                "budget spent. A job's name opens its Training run dashboard.",
                {
                    "Accrued": Query(_per_job("kubetune_finetunejob_accrued_cost_usd")),
                    "Estimated": Query(_per_job("kubetune_finetunejob_estimated_cost_usd")),
                    "Budget": Query(_per_job("kubetune_finetunejob_budget_usd")),
                    "Budget spent": Query(
                        f"{_per_job('kubetune_finetunejob_accrued_cost_usd')} "
                        f"/ {_per_job('kubetune_finetunejob_budget_usd')}"
                    ),
                },
                unit="currencyUSD",
                units={"Budget spent": "percentunit"},
                span=12,
            )
        )
        .with_row(Row("Failures and recoveries"))
        .with_panel(
            ts(
                "Recoveries by reason",
                "OOM, preemption, pod failure and lost-node recoveries in the last hour.",
                "short",
                Query(
                    "sum by (reason) "
                    f"(increase(kubetune_finetunejob_recoveries_total{{{NS}}}[1h]))",
                    "{{reason}}",
                ),
            )
        )
        .with_panel(
            ts(
                "Finished jobs",
                "Jobs that reached Succeeded or Failed in the last hour.",
                "short",
                Query(
                    "sum by (phase) (increase(kubetune_finetunejobs_finished_total[1h]))",
                    "{{phase}}",
                ),
            )
        )
        .with_panel(
            tab(
                "Estimator error: trainer peak / planned memory",
                "One row per job with a live trainer: its peak reserved GPU memory (global "
                "rank 0), the planner's per-GPU estimate, the GPU's memory, and peak / planned. "
                "Above 100 %: the trainer reserved more than planned (the safety factor "
                "absorbs some); far below: the plan wastes GPUs. A job's name opens its "
                "Training run dashboard.",
                {
                    "Peak / planned": Query(
                        f"{_per_job('kubetune_trainer_memory_reserved_peak_bytes', 'max')} "
                        "/ on (namespace, finetunejob) "
                        f"{_per_job('kubetune_finetunejob_estimated_gpu_memory_bytes', 'max')}"
                    ),
                    "Peak reserved": Query(
                        _per_job("kubetune_trainer_memory_reserved_peak_bytes", "max")
                    ),
                    "Planned": Query(
                        _per_job("kubetune_finetunejob_estimated_gpu_memory_bytes", "max")
                    ),
                    "GPU memory": Query(
                        _per_job("kubetune_finetunejob_gpu_memory_capacity_bytes", "max")
                    ),
                },
                unit="bytes",
                units={"Peak / planned": "percentunit"},
            )
        )
        .with_row(Row("Operator"))
        .with_panel(
            ts(
                "Reconcile duration",
                "Handler run time, p50/p95/p99 over all handlers.",
                "s",
                *[
                    Query(
                        f"histogram_quantile({q}, sum by (le) "
                        f"(rate(kubetune_reconcile_duration_seconds_bucket[{RATE}])))",
                        f"p{int(q * 100)}",
                    )
                    for q in (0.5, 0.95, 0.99)
                ],
                span=8,
            )
        )
        .with_panel(
            ts(
                "Reconcile errors",
                "Handler runs that raised, per second, by handler (0 when none).",
                "ops",
                Query(
                    f"sum by (handler) (rate(kubetune_reconcile_errors_total[{RATE}])) "
                    f"or {zero_per_handler}",
                    "{{handler}}",
                ),
                span=8,
            )
        )
        .with_panel(
            ts(
                "Operator memory",
                "Resident memory of the operator process.",
                "bytes",
                Query(
                    "process_resident_memory_bytes * on (instance, job) group_left () "
                    "kubetune_operator_info",
                    "memory {{instance}}",
                ),
                span=8,
            )
        )
    )


# --------------------------------------------------------------------------- one run


def training_run() -> Dashboard:
    job_var = (
        QueryVariable("finetunejob")
        .label("FineTuneJob")
        .datasource(DS)
        .query('label_values(kubetune_finetunejob_info{namespace="$namespace"}, finetunejob)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .hide(VariableHide.DONT_HIDE)
    )
    trainer = f"{{{JOB}}}"
    return (
        Dashboard("kubetune / Training run")
        .uid(RUN_UID)
        .description("One FineTuneJob: loss, throughput, MFU, memory, progress, cost.")
        .tags(["kubetune"])
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .links([other_dashboards()])
        .with_variable(datasource_var())
        .with_variable(namespace_var(multi=False))
        .with_variable(job_var)
        .with_row(Row("Status"))
        .with_panel(
            single(
                "Phase",
                "The job's phase and plan (pool, method).",
                "none",
                Query(f"kubetune_finetunejob_info{trainer}", "{{phase}} on {{pool}} ({{method}})"),
                text_mode=BigValueTextMode.NAME,
                span=8,
            )
        )
        .with_panel(
            single(
                "Progress",
                "Optimizer steps done out of those planned.",
                "percentunit",
                Query(f"kubetune_finetunejob_progress_ratio{trainer}"),
            )
        )
        .with_panel(
            single(
                "ETA",
                "Estimated training time left, from measured throughput.",
                "s",
                Query(f"kubetune_finetunejob_eta_seconds{trainer}"),
            )
        )
        .with_panel(
            single(
                "Restarts",
                "Trainer relaunches (preemption, OOM re-plans, pod failures).",
                "short",
                Query(f"kubetune_finetunejob_restarts_total{trainer}"),
                thresholds=[(None, "green"), (1, "orange"), (3, "red")],
            )
        )
        .with_panel(
            single(
                "GPUs",
                "GPUs of the current plan.",
                "short",
                Query(f"sum(kubetune_finetunejob_gpus{trainer})"),
            )
        )
        .with_row(Row("Training"))
        .with_panel(
            ts(
                "Loss",
                "Training loss of the last optimizer step and validation loss at the last eval.",
                "none",
                Query(f"max(kubetune_trainer_loss{trainer})", "train"),
                Query(f"max(kubetune_trainer_eval_loss{trainer})", "eval"),
            )
        )
        .with_panel(
            ts(
                "Throughput: measured and planned",
                "Trained tokens per second over all ranks, against the planner's estimate.",
                "suffix: tok/s",
                Query(f"max(kubetune_trainer_tokens_per_second{trainer})", "measured"),
                Query(f"max(kubetune_finetunejob_estimated_tokens_per_second{trainer})", "planned"),
            )
        )
        .with_panel(
            ts(
                "MFU",
                "Model FLOPs utilization against the GPU's dense bf16 peak (empty on CPU).",
                "percentunit",
                Query(f"max(kubetune_trainer_mfu_ratio{trainer})", "MFU"),
            )
        )
        .with_panel(
            ts(
                "Learning rate",
                "Learning rate of the last optimizer step.",
                "sci",
                Query(f"max(kubetune_trainer_learning_rate{trainer})", "lr"),
            )
        )
        .with_row(Row("Preference training (DPO)"))
        .with_panel(
            ts(
                "DPO reward accuracy",
                "DPO jobs: the fraction of preference pairs whose chosen answer has the larger "
                "implicit reward, over the last optimizer step's pairs (train) and the "
                "validation pairs at the last evaluation (eval). 0 before the first step (a "
                "tie is not accurate); empty for SFT jobs.",
                "percentunit",
                Query(f"max(kubetune_trainer_dpo_reward_accuracy{trainer})", "train"),
                Query(f"max(kubetune_trainer_eval_dpo_reward_accuracy{trainer})", "eval"),
                bounds=(0, 1),
            )
        )
        .with_panel(
            ts(
                "DPO reward margin",
                "DPO jobs: the mean chosen minus rejected implicit reward (β times the "
                "log-probability gained over the reference model) on the last step's pairs "
                "(train) and on the validation pairs (eval), and the mean rewards of the "
                "chosen and the rejected answers of the last step. Empty for SFT jobs.",
                "none",
                Query(f"max(kubetune_trainer_dpo_reward_margin{trainer})", "train margin"),
                Query(f"max(kubetune_trainer_eval_dpo_reward_margin{trainer})", "eval margin"),
                Query(f"max(kubetune_trainer_dpo_rewards_chosen{trainer})", "chosen"),
                Query(f"max(kubetune_trainer_dpo_rewards_rejected{trainer})", "rejected"),
            )
        )
        .with_row(Row("GPU memory"))
        .with_panel(
            ts(
                "GPU memory: planned and actual",
                "Per GPU: the memory of the planned GPU (dashed red, the ceiling), the "
                "planner's estimate, and the trainer's peak reserved and allocated memory. "
                "The peaks are global rank 0's only: only rank 0 serves metrics and the "
                "chart's PodMonitor scrapes only the pod with completion index 0. The memory "
                "every GPU of every rank uses is in GPU memory used per GPU (DCGM).",
                "bytes",
                Query(
                    f"max(kubetune_finetunejob_gpu_memory_capacity_bytes{trainer})", "GPU memory"
                ),
                Query(f"max(kubetune_finetunejob_estimated_gpu_memory_bytes{trainer})", "planned"),
                Query(
                    f"max(kubetune_trainer_memory_reserved_peak_bytes{trainer})",
                    "rank 0 peak reserved",
                ),
                Query(
                    f"max(kubetune_trainer_memory_allocated_peak_bytes{trainer})",
                    "rank 0 peak allocated",
                ),
                overrides=[("A", ceiling_line())],
            )
        )
        .with_panel(
            ts(
                "Estimator error",
                "Rank 0's peak reserved memory / the planner's estimate. Above 100 % the "
                "estimate was low.",
                "percentunit",
                Query(
                    f"max(kubetune_trainer_memory_reserved_peak_bytes{trainer}) "
                    f"/ max(kubetune_finetunejob_estimated_gpu_memory_bytes{trainer})",
                    "peak / planned",
                ),
            )
        )
        .with_row(Row("GPUs and pods (DCGM exporter, cAdvisor)"))
        .with_panel(
            ts(
                "GPU utilisation per GPU (DCGM)",
                "Every GPU of every pod of this job (all ranks and attempts), from NVIDIA's "
                "DCGM exporter (DCGM_FI_DEV_GPU_UTIL) run with its Kubernetes pod mapping and "
                "scraped with its pod and namespace labels kept (honorLabels). No data without "
                "the DCGM exporter.",
                "percent",
                Query(f"DCGM_FI_DEV_GPU_UTIL{{{PODS}}}", "{{pod}} GPU {{gpu}}"),
                span=8,
                bounds=(0, 100),
            )
        )
        .with_panel(
            ts(
                "GPU memory used per GPU (DCGM)",
                "Memory in use on every GPU of every pod of this job (all ranks and attempts), "
                "from NVIDIA's DCGM exporter (DCGM_FI_DEV_FB_USED, MiB, shown in bytes), under "
                "the planned GPU's memory (dashed red). No data without the DCGM exporter; the "
                "line of the GPU's memory comes from the operator.",
                "bytes",
                Query(
                    f"max(kubetune_finetunejob_gpu_memory_capacity_bytes{trainer})", "GPU memory"
                ),
                Query(f"DCGM_FI_DEV_FB_USED{{{PODS}}} * 1048576", "{{pod}} GPU {{gpu}}"),
                span=8,
                overrides=[("A", ceiling_line())],
            )
        )
        .with_panel(
            ts(
                "Trainer pod memory (cAdvisor)",
                "Host memory (working set, /dev/shm included) of the trainer container of every "
                "pod of this job, from cAdvisor in the kubelet "
                "(container_memory_working_set_bytes). No data where Prometheus does not scrape "
                "the kubelet's cAdvisor endpoint.",
                "bytes",
                Query(
                    "sum by (pod) "
                    f'(container_memory_working_set_bytes{{{PODS}, container="trainer"}})',
                    "{{pod}}",
                ),
                span=8,
            )
        )
        .with_row(Row("Progress and cost"))
        .with_panel(
            ts(
                "Steps",
                "Optimizer steps done (operator's and trainer's view) against the plan.",
                "short",
                Query(f"max(kubetune_trainer_step{trainer})", "trainer"),
                Query(f"max(kubetune_finetunejob_step{trainer})", "operator"),
                Query(f"max(kubetune_finetunejob_total_steps{trainer})", "planned"),
            )
        )
        .with_panel(
            ts(
                "Cost: accrued, estimated, budget",
                "Money spent so far against the plan and spec.resources.maxCostUSD.",
                "currencyUSD",
                Query(f"max(kubetune_finetunejob_accrued_cost_usd{trainer})", "accrued"),
                Query(f"max(kubetune_finetunejob_estimated_cost_usd{trainer})", "estimated"),
                Query(f"max(kubetune_finetunejob_budget_usd{trainer})", "budget"),
            )
        )
        .with_panel(
            ts(
                "Checkpoints",
                "Step of the newest complete checkpoint (left axis), and how long the last "
                "one took to write (right axis).",
                "short",
                Query(f"max(kubetune_finetunejob_checkpoint_step{trainer})", "checkpoint step"),
                Query(f"max(kubetune_trainer_checkpoint_save_seconds{trainer})", "save time"),
                overrides=[("B", right_axis("s"))],
            )
        )
        .with_panel(
            ts(
                "Recoveries",
                "Failures the operator handled for this job, by reason.",
                "short",
                Query(
                    f"sum by (reason) (kubetune_finetunejob_recoveries_total{trainer})",
                    "{{reason}}",
                ),
            )
        )
    )


DASHBOARDS = {"jobs-overview": jobs_overview, "training-run": training_run}
ANNOTATIONS = {
    "jobs-overview": lambda: [
        builtin_annotation(),
        recoveries_annotation(NS, "Recovery of {{namespace}}/{{finetunejob}}: {{reason}}"),
    ],
    "training-run": lambda: [
        builtin_annotation(),
        recoveries_annotation(JOB, "Recovery: {{reason}}"),
        checkpoints_annotation(),
    ],
}


def render() -> dict[str, str]:
    """File name → JSON text of each dashboard."""
    out = {}
    for name, build in DASHBOARDS.items():
        model = json.loads(json.dumps(build().build(), cls=JSONEncoder))
        # Prometheus annotation queries carry fields (step, titleFormat, tagKeys) the SDK's
        # model does not have.
        model["annotations"] = {"list": ANNOTATIONS[name]()}
        # Panel ids must be unique within a dashboard (links and alerts refer to them).
        for i, panel in enumerate(model["panels"], start=1):
            panel["id"] = i
        out[f"{name}.json"] = json.dumps(model, indent=2, sort_keys=True) + "\n"
    return out


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, rows included."""
    found = []
    for panel in dashboard.get("panels", []):
        for sub in [panel, *panel.get("panels", [])]:
            for target in sub.get("targets") or []:
                if target.get("expr"):
                    found.append((str(sub.get("title")), str(target["expr"])))
    return found


def main(argv: list[str]) -> int:
    files = render()
    if "--check" in argv:
        stale = [
            n
            for n, text in files.items()
            if not (OUT / n).exists() or (OUT / n).read_text() != text
        ]
        for name in stale:
            print(f"{OUT / name} is out of date: run python hack/gen_dashboards.py")
        return 1 if stale else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.json"):
        if old.name not in files:
            old.unlink()
    for name, text in files.items():
        (OUT / name).write_text(text)
        print(f"wrote {(OUT / name).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
