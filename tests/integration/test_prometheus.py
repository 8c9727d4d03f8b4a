"""Dashboards and alerts against a real Prometheus (Debian's `prometheus` package).

* `promtool check rules` on the chart's PrometheusRule, and `promtool test rules` with a
  firing and a quiet case for each alert.
* A Prometheus started on loopback scrapes a live operator metrics endpoint (the real
  `OperatorMetrics`, fed with statuses of several jobs through the handlers' API) and a live
  trainer: `python -m kubetune_trainer` fine-tuning a tiny random-init model with LoRA on CPU,
  with DPO on preference pairs (its metrics are SFT's and the DPO rewards, so every panel
  has its data), checkpointing and evaluating every few steps, its metrics on a loopback
  port. While it
  trains, every PromQL expression of every dashboard panel, variable and annotation must
  return data (but those of the panels fed by the DCGM exporter and cAdvisor, which this test
  does not run: they are reported), and every number must be finite (MFU is measured against
  this CPU's own matmul rate, passed as `KUBETUNE_PEAK_TFLOPS`). Then the trainer is
  preempted with SIGTERM: it must checkpoint and exit 42.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetune.controller.metrics import OperatorMetrics
from kubetune_dev.binaries import Binaries
from kubetune_dev.cluster import free_port
from kubetune_trainer.contract import EXIT_PREEMPTED, TrainerConfig
from support.helm import Helm
from support.waiting import WaitTimeout, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/kubetune"
DASHBOARDS = CHART / "dashboards"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="needs Debian's prometheus package (apt-get install prometheus)",
)
needs_trainer = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "peft")),
    reason="the live trainer needs the trainer extra (pip install -e '.[trainer]')",
)

INFO = (
    'namespace="a",finetunejob="{job}",phase="{phase}",pool="l40s",method="lora",'
    'gpu_product="X",spot="false"'
)
# What each alert says when it fires in the test below: the annotations' templates render.
SAYS = {
    "KubetuneJobStuckQueued": (
        "FineTuneJob waits for GPUs",
        "a/q has been Queued for more than 30m: no allowed pool has enough free GPUs. Free "
        "capacity, allow more pools (spec.resources.pools) or lower spec.resources.gpus.",
    ),
    "KubetuneRepeatedOOMRecoveries": (
        "FineTuneJob keeps running out of memory",
        "a/o recovered from 2 out-of-memory failures (GPU or host) within 1h. The memory "
        "estimate is too low for this model or data; check the job's recoveries, and "
        "kubetune_finetunejob_estimated_gpu_memory_bytes against the trainer's peak.",
    ),
    "KubetuneBudgetNearlySpent": (
        "FineTuneJob has nearly spent its budget",
        "a/b has spent 95% of spec.resources.maxCostUSD; the operator stops it cleanly at 100 %.",
    ),
    "KubetuneNoProgress": (
        "FineTuneJob makes no progress",
        "a/s is Running but its step count has not moved for 15 minutes. Check the trainer "
        "pod's logs (a hung collective, a slow model download, a stalled volume).",
    ),
    "KubetuneReconcileStale": (
        "kubetune operator no longer reconciles a job",
        "The operator has not completed a reconcile of a/stale for 15 minutes. See the "
        "operator's log for errors (status writes refused, the API server unreachable); "
        "liveness restarts an operator that stalled on every job.",
    ),
    "KubetuneReconcileErrors": (
        "kubetune operator handlers keep failing",
        "The finetunejob handler failed 166.7m times per second over the last 10 minutes; "
        "see the operator's log.",
    ),
    "KubetuneJobFailed": (
        "FineTuneJob failed",
        "a/f is Failed. Its Failed condition's reason and message say why and what to change; "
        "its checkpoint volume keeps the last complete checkpoint to resume from.",
    ),
    "KubetuneOperatorAbsent": (
        "No kubetune operator is being scraped",
        "Prometheus has scraped no kubetune operator for 10m: no job is planned, launched, "
        "recovered or billed meanwhile (running trainers go on). Check the operator's "
        "Deployment and its metrics scrape.",
    ),
}
SEVERITY = {"KubetuneOperatorAbsent": "critical"}
RUNBOOK = ROOT / "docs/runbook.md"
EXTERNAL = {
    "DCGM_FI_DEV_GPU_UTIL": "NVIDIA's DCGM exporter",
    "DCGM_FI_DEV_FB_USED": "NVIDIA's DCGM exporter",
    "container_memory_working_set_bytes": "cAdvisor (a kubelet)",
}
"""Metrics of other exporters some panels use; nothing here exports them, so their queries are
left out of the live check (and reported)."""


def rules_file(tmp: Path, helm: Helm) -> Path:
    out = helm(
        "template", "r", str(CHART), "--set", "prometheusRule.enabled=true",
        "--show-only", "templates/prometheusrule.yaml",
    ).stdout  # fmt: skip
    rule = yaml.safe_load(out)
    path = tmp / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def alert(name: str, at: str, labels: dict[str, str] | None) -> dict[str, Any]:
    summary, description = SAYS[name]
    exp = (
        []
        if labels is None
        else [
            {
                "exp_labels": {"severity": SEVERITY.get(name, "warning"), **labels},
                "exp_annotations": {
                    "summary": summary,
                    "description": description,
                    "runbook_url": f"docs/runbook.md#{name.lower()}",
                },
            }
        ]
    )
    return {"eval_time": at, "alertname": name, "exp_alerts": exp}


@needs_prometheus
def test_promtool_checks_and_tests_the_alert_rules(tmp_path: Path, binaries: Binaries) -> None:
    rules = rules_file(tmp_path, Helm(binaries.helm))
    out = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    job = lambda j: {"namespace": "a", "finetunejob": j}  # noqa: E731
    series = [
        # Queued for 40 minutes; another job queued only from minute 20.
        (f"kubetune_finetunejob_info{{{INFO.format(job='q', phase='Queued')}}}", "1x40"),
        (f"kubetune_finetunejob_info{{{INFO.format(job='q2', phase='Queued')}}}", "_x20 1x20"),
        # Two out-of-memory recoveries within the hour, one GPU and one host; another job
        # has one.
        (
            'kubetune_finetunejob_recoveries_total{namespace="a",finetunejob="o",reason="OOM"}',
            "0 0 1 1 1 1 1 1 1 1 1",
        ),
        (
            'kubetune_finetunejob_recoveries_total{namespace="a",finetunejob="o",'
            'reason="HostOutOfMemory"}',
            "0 0 0 0 1 1 1 1 1 1 1",
        ),
        (
            'kubetune_finetunejob_recoveries_total{namespace="a",finetunejob="o1",reason="OOM"}',
            "0 0 1 1 1 1 1 1 1 1 1",
        ),
        # Budget: b at 95 %, c at 50 %, d at 99 % but already Succeeded.
        ('kubetune_finetunejob_accrued_cost_usd{namespace="a",finetunejob="b"}', "9.5x40"),
        ('kubetune_finetunejob_budget_usd{namespace="a",finetunejob="b"}', "10x40"),
        ('kubetune_finetunejob_accrued_cost_usd{namespace="a",finetunejob="c"}', "5x40"),
        ('kubetune_finetunejob_budget_usd{namespace="a",finetunejob="c"}', "10x40"),
        ('kubetune_finetunejob_accrued_cost_usd{namespace="a",finetunejob="d"}', "9.9x40"),
        ('kubetune_finetunejob_budget_usd{namespace="a",finetunejob="d"}', "10x40"),
        (f"kubetune_finetunejob_info{{{INFO.format(job='d', phase='Succeeded')}}}", "1x40"),
        # No progress: s stuck since t=0 while Running; p progresses every minute.
        (
            'kubetune_finetunejob_last_progress_timestamp_seconds{namespace="a",finetunejob="s"}',
            "0x40",
        ),
        (f"kubetune_finetunejob_info{{{INFO.format(job='s', phase='Running')}}}", "1x40"),
        (
            'kubetune_finetunejob_last_progress_timestamp_seconds{namespace="a",finetunejob="p"}',
            "0+60x40",
        ),
        (f"kubetune_finetunejob_info{{{INFO.format(job='p', phase='Running')}}}", "1x40"),
        # One handler failing 10 times a minute, another never.
        ('kubetune_reconcile_errors_total{handler="finetunejob",error="ApiError"}', "0+10x40"),
        ('kubetune_reconcile_errors_total{handler="gpupool",error="ApiError"}', "0x40"),
        # Last reconcile: stale stopped at t=0; fresh is reconciled every minute.
        (
            'kubetune_finetunejob_last_reconcile_timestamp_seconds{namespace="a",finetunejob="stale"}',
            "0x40",
        ),
        (
            'kubetune_finetunejob_last_reconcile_timestamp_seconds{namespace="a",finetunejob="fresh"}',
            "0+60x40",
        ),
        # f fails at minute 10.
        (f"kubetune_finetunejob_info{{{INFO.format(job='f', phase='Running')}}}", "1x9"),
        (f"kubetune_finetunejob_info{{{INFO.format(job='f', phase='Failed')}}}", "_x10 1x30"),
        # The operator is scraped for 20 minutes, then no more.
        ('kubetune_operator_info{version="0.1.0"}', "1x20"),
    ]
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [
                    alert("KubetuneJobStuckQueued", "20m", None),
                    alert("KubetuneJobStuckQueued", "35m", job("q")),
                    alert("KubetuneRepeatedOOMRecoveries", "6m", job("o")),
                    alert("KubetuneBudgetNearlySpent", "5m", job("b")),
                    alert("KubetuneNoProgress", "10m", None),
                    alert("KubetuneNoProgress", "20m", job("s")),
                    alert("KubetuneReconcileErrors", "10m", None),
                    alert("KubetuneReconcileErrors", "30m", {"handler": "finetunejob"}),
                    alert("KubetuneReconcileStale", "10m", None),
                    alert("KubetuneReconcileStale", "20m", job("stale")),
                    alert("KubetuneJobFailed", "5m", None),
                    alert("KubetuneJobFailed", "15m", job("f")),
                    alert("KubetuneOperatorAbsent", "20m", None),
                    alert("KubetuneOperatorAbsent", "30m", None),  # absent, not yet for 10m
                    alert("KubetuneOperatorAbsent", "40m", {}),
                ],
            }
        ],
    }
    path = tmp_path / "rules_test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    out = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # Each alert of the rule file has a test that expects it to fire.
    defined = {r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]}
    fired = {
        t["alertname"]
        for t in tests["tests"][0]["alert_rule_test"]  # type: ignore[index]
        if t["exp_alerts"]
    }
    assert defined == fired
    # Each alert links to its own section of the runbook.
    sections = {
        line[4:].strip() for line in RUNBOOK.read_text().splitlines() if line.startswith("### ")
    }
    assert defined <= sections, defined - sections


# ---------------------------------------------------------------------- live scrape


def _status(**over: Any) -> dict[str, Any]:
    plan = {
        "revision": 1, "reason": "Initial", "method": "lora", "pool": "l40s",
        "gpuProduct": "NVIDIA-L40S", "gpuMemoryGiB": 48, "nodes": 1, "gpusPerNode": 2,
        "totalGPUs": 2, "spot": False, "sharding": "full", "precision": "bf16",
        "optimizer": "adamw", "microBatchSize": 1, "gradientAccumulation": 4,
        "gradientCheckpointing": True, "perGPUMemoryGiB": 20.5, "trainableParams": 1,
        "modelParams": 2, "totalSteps": 100, "totalTokens": 1000,
        "estimatedTokensPerSecond": 5000.0, "estimatedDurationSeconds": 100.0,
        "estimatedCostUSD": 0.5, "pricePerHourUSD": 1.58,
    }  # fmt: skip
    return {"plan": plan, **over}


def _body(name: str, status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "team-a", "name": name,
                     "creationTimestamp": "2025-01-01T00:00:00Z"},
        "spec": spec,
        "status": status or {},
    }  # fmt: skip


def feed(m: OperatorMetrics) -> None:
    """Walk a few jobs through their lives with the API the handlers use."""
    now = time.time()
    queued = _status(
        phase="Queued",
        conditions=[{"type": "Queued", "status": "True", "reason": "X",
                     "lastTransitionTime": "2025-01-01T00:00:10Z"}],
    )  # fmt: skip
    running = _status(
        phase="Running",
        startTime="2025-01-01T00:02:00Z",
        progress={"step": 40, "totalSteps": 100, "etaSeconds": 600.0},
        cost={"accruedUSD": 0.2, "estimatedUSD": 0.5, "rateUSDPerHour": 1.58},
        checkpoint={"latestStep": 40, "time": "2025-01-01T00:10:00Z"},
        restarts=1,
        recoveries=[{"reason": "OOM", "time": "2025-01-01T00:05:00Z"}],
    )
    with m.reconcile_timer("finetunejob"):
        m.observe_job(_body("run-1", resources={"maxCostUSD": 1.0}), queued, now=now)
    with m.reconcile_timer("finetunejob"):
        m.observe_job(_body("run-1", queued, resources={"maxCostUSD": 1.0}), running, now=now)
    m.observe_job(_body("waiting"), queued, now=now)
    done = _status(phase="Succeeded", startTime="2025-01-01T00:01:00Z")
    m.observe_job(_body("done", _status(phase="Running")), done, now=now)
    m.observe_job(_body("broken", _status(phase="Running")), _status(phase="Failed"), now=now)
    with pytest.raises(RuntimeError), m.reconcile_timer("finetunejob"):
        raise RuntimeError("simulated API outage")
    for pool, free in (("l40s", 30), ("h100", 16)):
        with m.reconcile_timer("gpupool"):
            m.observe_pool(
                {"metadata": {"name": pool}, "spec": {"pricePerGPUHour": 0.79}},
                {"nodes": 4, "allocatableGPUs": 32, "freeGPUs": free},
            )


TRAINER_TIMEOUT_S = 120


def cpu_matmul_tflops(n: int = 512) -> float:
    """Dense fp32 matmul rate of one thread of this CPU (the trainer runs with one thread).

    A GPU's MFU is measured against its dense bf16 peak; this is the same ratio for a CPU run,
    against what this CPU itself achieves on a large matmul.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(4):
                a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 4 * 2 * n**3 / best / 1e12


@dataclass
class LiveTrainer:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    """The trainer's JSON-lines metrics log."""
    output: Path
    """Its stdout and stderr."""
    peak_tflops: float

    def tail(self) -> str:
        return self.output.read_text(errors="replace")[-3000:]


def start_trainer(tmp: Path) -> LiveTrainer:
    """A real trainer run on CPU: tiny Llama, LoRA, DPO, checkpoint and evaluation every 25
    steps.

    It is planned far longer than the test lasts; the test preempts it.
    """
    from kubetune_trainer.tiny import make_model, make_preference_records, write_jsonl

    model = make_model(tmp / "model")
    data = write_jsonl(tmp / "data.jsonl", make_preference_records(200))
    steps = 100_000
    config = {
        "job": {"name": "run-1", "namespace": "team-a", "uid": "u1"},
        "method": "lora",
        "model": {"source": str(model), "kind": "path"},
        "dataset": {"source": str(data), "format": "alpaca", "validation_split": 0.1},
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.05},
        "training": {
            "total_steps": steps, "max_steps": steps, "micro_batch_size": 2,
            "gradient_accumulation": 2, "global_batch_size": 4, "sequence_length": 128,
            "precision": "fp32", "learning_rate": 2e-3, "warmup_ratio": 0.0,
            "gradient_checkpointing": False, "objective": "dpo", "dpo": {"beta": 0.1},
        },
        "checkpoint": {"dir": str(tmp / "ckpt"), "interval_steps": 25, "interval_minutes": 0,
                       "keep": 2},
        "output": {"dir": str(tmp / "out")},
        "metrics": {"port": 0, "log_path": str(tmp / "metrics.jsonl")},
    }  # fmt: skip
    (tmp / "config.json").write_text(TrainerConfig.model_validate(config).to_json())
    peak = cpu_matmul_tflops()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        KUBETUNE_METRICS_ADDR="127.0.0.1",  # other runs may share this machine
        KUBETUNE_PEAK_TFLOPS=f"{peak:.6f}",
    )
    output = tmp / "trainer.out"
    with output.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kubetune_trainer", "--config", str(tmp / "config.json")],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    log = tmp / "metrics.jsonl"
    trainer = LiveTrainer(proc=proc, port=0, log=log, output=output, peak_tflops=peak)

    def metrics_port() -> int | None:
        """The port the trainer's start line names, once it is written."""
        assert proc.poll() is None, f"trainer exited {proc.returncode}:\n{trainer.tail()}"
        if log.exists():
            complete = log.read_text().split("\n")[:-1]  # not a line still being written
            for event in map(json.loads, complete):
                if event["event"] == "start":
                    return int(event["metrics_port"])
        return None

    try:
        trainer.port = wait_for("the trainer's start line", metrics_port, TRAINER_TIMEOUT_S, 0.2)
    except WaitTimeout as exc:
        raise AssertionError(f"trainer did not start: {exc}\n{trainer.tail()}") from None
    return trainer


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


# What must hold before the dashboards are checked: both targets up and scraped several
# times, and the trainer has stepped between scrapes, checkpointed, evaluated and measured MFU.
READY = [
    "min(count_over_time(up[1m])) >= 5 and min(up) == 1",
    "changes(kubetune_trainer_step[1m]) >= 3",
    "kubetune_trainer_last_checkpoint_step > 0",
    "kubetune_trainer_eval_loss > 0",
    "kubetune_trainer_eval_dpo_reward_accuracy >= 0",
    "kubetune_trainer_mfu_ratio > 0",
]


FED_TWICE = 'kubetune_reconcile_duration_seconds_count{handler="gpupool"} >= 4'
"""True once Prometheus scraped the operator after the second `feed` (its last event is the
fourth pool reconcile)."""


@dataclass
class Live:
    url: str
    trainer: LiveTrainer


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    operator = OperatorMetrics()
    op_port = operator.start_server(0, addr="127.0.0.1")
    trainer = start_trainer(tmp_path / "trainer")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {   # as the chart's ServiceMonitor: keep the jobs' own namespace label
                "job_name": "kubetune-operator",
                "honor_labels": True,
                "static_configs": [{"targets": [f"127.0.0.1:{op_port}"]}],
            },
            {   # as the chart's PodMonitor relabelling does for a trainer pod
                "job_name": "kubetune-trainers",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{trainer.port}"],
                        "labels": {"namespace": "team-a", "finetunejob": "run-1",
                                   "attempt": "1"},
                    }
                ],
            },
        ],
    }  # fmt: skip
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def why() -> str:
        return (
            f"prometheus log:\n{(tmp_path / 'prometheus.log').read_text()[-2000:]}\n"
            f"trainer output:\n{trainer.tail()}"
        )

    def holds(*exprs: str) -> bool:
        assert proc.poll() is None, why()
        assert trainer.proc.poll() is None, why()
        try:
            return all(query(url, expr) for expr in exprs)
        except OSError:
            return False  # not listening yet

    try:
        feed(operator)
        try:
            wait_for(f"{READY} to hold", partial(holds, *READY), 90)
            # A second round of events between scrapes, so rates and increases move: wait
            # until Prometheus has scraped its last event.
            feed(operator)
            wait_for(f"{FED_TWICE} to hold", partial(holds, FED_TWICE), 30, 0.2)
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}\n{why()}") from None
        yield Live(url=url, trainer=trainer)
    finally:
        stop(trainer.proc)
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        operator.stop_server()


def query(url: str, expr: str) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=5) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def substitute(expr: str, multi: bool) -> str:
    return (
        expr.replace("$namespace", "team-a|other" if multi else "team-a")
        .replace("$finetunejob", "run-1")
        .replace("$__rate_interval", "30s")
    )


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    return [sub for panel in dashboard["panels"] for sub in [panel, *panel.get("panels", [])]]


@needs_prometheus
@needs_trainer
def test_every_dashboard_query_returns_data_from_a_live_run(live: Live) -> None:
    checked = 0
    empty = []
    not_finite = []
    left_out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text())
        multi = path.stem == "jobs-overview"
        for var in dashboard["templating"]["list"]:
            if var["type"] == "query":
                # label_values(metric{...}, label): the label must have values.
                inner = var["query"].removeprefix("label_values(").removesuffix(")")
                selector, label = inner.rsplit(",", 1)
                result = query(
                    live.url, f"count by ({label.strip()}) ({substitute(selector, multi)})"
                )
                checked += 1
                if not result:
                    empty.append(f"{path.stem} variable {var['name']}: {var['query']}")
        for annotation in dashboard["annotations"]["list"]:
            if "expr" not in annotation:
                continue
            # `changes(...) > 0`: valid PromQL whose series exist (no change is due meanwhile).
            expr = substitute(annotation["expr"], multi)
            query(live.url, expr)
            checked += 1
            if not query(live.url, expr.removesuffix(" > 0")):
                empty.append(f"{path.stem} annotation {annotation['name']}: {expr}")
        for panel in panels(dashboard):
            for target in panel.get("targets") or []:
                expr = substitute(target["expr"], multi)
                others = sorted({EXTERNAL[m] for m in EXTERNAL if m in expr})
                if others:
                    query(live.url, expr)  # valid PromQL all the same
                    left_out.append(f"{path.stem} / {panel['title']}: needs {' and '.join(others)}")
                    continue
                checked += 1
                result = query(live.url, expr)
                if not result:
                    empty.append(f"{path.stem} / {panel['title']}: {expr}")
                values = [float(r["value"][1]) for r in result]
                if not all(math.isfinite(v) for v in values):
                    not_finite.append(f"{path.stem} / {panel['title']}: {expr} = {values}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert not not_finite, "queries with NaN or infinite values:\n" + "\n".join(not_finite)
    assert checked >= 50
    print(
        f"\n{len(left_out)} queries not checked for data: no DCGM exporter or cAdvisor in this "
        "test environment:\n  " + "\n  ".join(left_out),
        file=sys.stderr,
    )
    # The trainer's series are the run's own numbers.
    trainer = live.trainer
    for expr, low, high in (
        ("kubetune_trainer_world_size", 1, 1),
        ("kubetune_trainer_total_steps", 100_000, 100_000),
        ("kubetune_trainer_step", 25, 100_000),
        ("kubetune_trainer_mfu_ratio", 1e-6, 1),
        ("kubetune_trainer_learning_rate", 1e-4, 2e-3),
        ("kubetune_trainer_memory_reserved_peak_bytes", 2**20, 2**40),
        ("kubetune_trainer_dpo_reward_accuracy", 0, 1),
        ("kubetune_trainer_eval_dpo_reward_accuracy", 0, 1),
        ("kubetune_trainer_eval_dpo_reward_margin", -10, 10),
    ):
        (sample,) = query(live.url, expr)
        assert low <= float(sample["value"][1]) <= high, (expr, sample, trainer.peak_tflops)
    # Everything above was read from a run that is still training: the series are not stale.
    assert trainer.proc.poll() is None, trainer.tail()
    print(
        f"\n{checked} dashboard queries returned data from a live trainer "
        f"(CPU peak {trainer.peak_tflops * 1e3:.1f} GFLOP/s)",
        file=sys.stderr,
    )
    # Preempted like a pod on a reclaimed node: checkpoint, then exit 42.
    trainer.proc.send_signal(signal.SIGTERM)
    assert trainer.proc.wait(timeout=60) == EXIT_PREEMPTED, trainer.tail()
    events = [json.loads(line) for line in trainer.log.read_text().splitlines()]
    (preempted,) = [e for e in events if e["event"] == "preempted"]
    assert preempted["last_checkpoint_step"] == preempted["step"] > 25
    assert (trainer.log.parent / "ckpt" / f"step-{int(preempted['step'])}").is_dir()
