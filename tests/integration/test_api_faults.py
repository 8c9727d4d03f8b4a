"""API fault drill: jobs finish while the API server misbehaves.

The operator runs as its own process, as users run it, but reaches the kube-apiserver only
through `support.faultproxy.FaultProxy` (plain HTTP on loopback; the proxy holds the admin
client certificate). The proxy forwards faithfully, watches included, and injects what
the drill asks for: throttling (429), server errors (500, 503), invalid-status answers
(422) on status writes, conflicts (409) on updates and patches, answers seconds late,
connections dropped before a request or before its answer, watch streams cut midway or
ended with a 410 Expired event, and a full outage (connection refused). Everything else of the
control plane (controllers, scheduler, kwok, and these tests' own reads and writes) talks
to the apiserver directly, so the cluster goes on while the operator's view is disturbed.

What must hold, each measured and printed:

* a flaky API (10–20 % of requests failing): every job succeeds, no attempt gets two
  batch Jobs, and no unfinished job goes long without a completed reconcile (the
  operator's `kubetune_finetunejob_last_reconcile_timestamp_seconds`);
* a 60 s outage while jobs run: the same operator process recovers by itself and every
  job, including those created during the outage, finishes;
* etcd stopped and started again while jobs run: every job finishes;
* one 422 on a job's status write, be it the first or the one that records success:
  the job keeps getting status writes and finishes.

Only this module's operator runs while its tests run. The `drill` fixture is
module-scoped: it stops the session-scoped `operator` fixture's process if an earlier
module started it (two operators would both reconcile these jobs, one of them without
faults) and starts it again afterwards for the modules that follow. No test here requests
`operator`.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubetune.api.vocabulary import LABEL_ATTEMPT, LABEL_JOB
from kubetune_dev.cluster import ADMIN, LocalCluster, free_port, process_alive
from support.apiserver import Api
from support.cluster import FAST_OPERATOR, Cluster, job_doc, start_operator
from support.faultproxy import Call, Fault, FaultProxy, Rule, faults, faults_table, rule
from support.waiting import wait_for

pytestmark = pytest.mark.integration

SEED = 20261124
RESYNC_SECONDS = 5
SETTINGS = {
    **FAST_OPERATOR,
    "KUBETUNE_RESYNC_SECONDS": str(RESYNC_SECONDS),
    "KUBETUNE_PROGRESS_WRITE_SECONDS": "2",
}
AGE_LIMIT_SECONDS = 30.0
"""The longest an unfinished job may go without a completed reconcile under a flaky API:
the resync period plus a few failed looks' backoff (2, 4, 8 s) and a status write's own
retries (about 8 s)."""
SAMPLE_SECONDS = 0.25
"""Often enough that a drill of twenty jobs finishing in about five seconds is still sampled
a dozen times or more."""
OUTAGE_SECONDS = 60.0
ETCD_DOWN_SECONDS = 10.0
REFUSED_SECONDS = 8.0
FTJ = "finetunejobs/status"
WATCHED = {"finetunejobs.kubetune.io", "gpupools.kubetune.io", "pods", "jobs.batch", "nodes"}
"""What the operator watches (its caches and its loops' wake-ups)."""
TERMINAL = ("Succeeded", "Failed")


@dataclass
class Drill:
    local: LocalCluster
    cluster: Cluster
    proxy: FaultProxy
    metrics_url: str
    pid: int


@pytest.fixture(scope="module")
def drill(local_cluster: LocalCluster, cluster: Cluster) -> Iterator[Drill]:
    """The operator behind the fault proxy (see the module docstring for why only it runs)."""
    restart_fixture_operator = "operator" in local_cluster.state.pids
    if restart_fixture_operator:
        assert local_cluster.stop_component("operator"), "the fixture operator did not stop"
    context = ssl.create_default_context(cafile=str(local_cluster.pki.ca_cert))
    cert, key = local_cluster.pki.client(ADMIN)
    context.load_cert_chain(str(cert), str(key))
    proxy = FaultProxy(local_cluster.server, context, seed=SEED).start()
    port = free_port()
    try:
        pid = start_operator(
            local_cluster,
            {**SETTINGS, "KUBETUNE_METRICS_PORT": str(port)},
            kubeconfig=local_cluster.kubeconfig_for(proxy.url, "faultproxy"),
        )

        def watching() -> set[str]:
            return WATCHED - {r.call.key for r in proxy.calls(verb="watch")}

        wait_for("the operator to watch " + ", ".join(sorted(WATCHED)), lambda: not watching(), 60)
        yield Drill(local_cluster, cluster, proxy, f"http://127.0.0.1:{port}/metrics", pid)
    finally:
        stopped = local_cluster.stop_component("operator")
        proxy.stop()
        if restart_fixture_operator:
            start_operator(local_cluster)
    assert stopped, "the drill's operator did not stop"


# ---------------------------------------------------------------------- reading the cluster


def finetunejobs(api: Api, namespace: str) -> dict[str, dict[str, Any]]:
    code, body = api.request(
        "GET", f"/apis/kubetune.io/v1alpha1/namespaces/{namespace}/finetunejobs"
    )
    assert code == 200, body
    return {obj["metadata"]["name"]: obj for obj in body["items"]}


def batch_jobs(api: Api, namespace: str) -> list[dict[str, Any]]:
    code, body = api.request("GET", f"/apis/batch/v1/namespaces/{namespace}/jobs")
    assert code == 200, body
    return list(body["items"])


def phase(obj: dict[str, Any]) -> str | None:
    return (obj.get("status") or {}).get("phase")


def phases(api: Api, namespace: str) -> Counter[str]:
    return Counter(str(phase(obj)) for obj in finetunejobs(api, namespace).values())


def wait_finished(
    drill: Drill, namespace: str, names: Iterable[str], timeout: float
) -> dict[str, dict[str, Any]]:
    """Every named job once all of them are Succeeded or Failed."""
    wanted = set(names)
    api = Api(drill.local)

    def probe() -> dict[str, dict[str, Any]] | None:
        assert process_alive(drill.pid), "the operator exited"
        jobs = finetunejobs(api, namespace)
        if wanted <= set(jobs) and all(phase(jobs[n]) in TERMINAL for n in wanted):
            return jobs
        return None

    try:
        return dict(wait_for(f"{len(wanted)} jobs to finish", probe, timeout, interval=0.5))
    except AssertionError as exc:
        raise AssertionError(f"{exc}; phases now: {dict(phases(api, namespace))}") from None
    finally:
        api.close()


def apply_jobs(drill: Drill, namespace: str, names: Iterable[str]) -> None:
    out = drill.cluster.apply(*(job_doc(n) for n in names), namespace=namespace)
    assert out.returncode == 0, out.stderr


def reconcile_ages(metrics_url: str, namespace: str) -> dict[str, float] | None:
    """Seconds since each unfinished job's last completed reconcile, from the operator's
    /metrics; None when the endpoint does not answer."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    now = time.time()
    ages = {}
    for family in text_string_to_metric_families(text):
        if family.name != "kubetune_finetunejob_last_reconcile_timestamp_seconds":
            continue
        for sample in family.samples:
            if sample.labels.get("namespace") == namespace:
                ages[sample.labels["finetunejob"]] = now - sample.value
    return ages


@dataclass
class Sampler:
    """Samples every SAMPLE_SECONDS, on a thread: each unfinished job's reconcile age, and
    the batch Jobs of each (job, attempt) straight from the apiserver."""

    drill: Drill
    namespace: str
    max_age: dict[str, float] = field(default_factory=dict)
    batch_names: dict[tuple[str, str], set[str]] = field(default_factory=lambda: defaultdict(set))
    scrapes: int = 0
    failed_scrapes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        api = Api(self.drill.local)
        self.sample_batch_jobs(api)
        api.close()

    def _run(self) -> None:
        api = Api(self.drill.local)
        try:
            while not self._stop.wait(SAMPLE_SECONDS):
                ages = reconcile_ages(self.drill.metrics_url, self.namespace)
                self.scrapes += 1
                if ages is None:
                    self.failed_scrapes += 1
                else:
                    for job, age in ages.items():
                        self.max_age[job] = max(age, self.max_age.get(job, 0.0))
                self.sample_batch_jobs(api)
        finally:
            api.close()

    def sample_batch_jobs(self, api: Api) -> None:
        for batch in batch_jobs(api, self.namespace):
            labels = batch["metadata"].get("labels") or {}
            owner = (labels.get(LABEL_JOB, "?"), labels.get(LABEL_ATTEMPT, "?"))
            self.batch_names[owner].add(batch["metadata"]["name"])

    def duplicates(self) -> dict[tuple[str, str], set[str]]:
        return {k: v for k, v in self.batch_names.items() if len(v) > 1}

    def worst_age(self) -> tuple[str, float]:
        if not self.max_age:
            return ("-", 0.0)
        job = max(self.max_age, key=lambda j: self.max_age[j])
        return job, self.max_age[job]


def status_patches(proxy: FaultProxy, namespace: str, name: str) -> list[Any]:
    return proxy.calls(verb="patch", resource=FTJ, namespace=namespace, name=name)


def report(title: str, **numbers: Any) -> None:
    print(f"\n[api-faults] {title}: " + ", ".join(f"{k}={v}" for k, v in numbers.items()))


# ---------------------------------------------------------------------- the drills


def flaky_api(namespace: str) -> list[Rule]:
    """About 15 % of the operator's requests fail, one way or another."""
    writes = ["create", "update", "patch", "delete"]
    return [
        rule(Fault.INVALID, 0.05, verbs=["patch"], resources=[FTJ], namespaces=[namespace]),
        rule(Fault.THROTTLE, 0.04),
        rule(Fault.SERVER_ERROR, 0.03),
        rule(Fault.UNAVAILABLE, 0.03),
        rule(Fault.DROP, 0.02),
        rule(Fault.LOST_REPLY, 0.03, verbs=writes),
        rule(Fault.CONFLICT, 0.03),  # updates and patches only
        rule(Fault.SLOW, 0.02, delay=(1.0, 4.0)),
        rule(Fault.EXPIRED_WATCH, 0.1),
        rule(Fault.CUT_WATCH, 0.5, cut_after=(1.0, 5.0)),
    ]


def test_jobs_succeed_through_a_flaky_api(drill: Drill, namespace: str) -> None:
    names = [f"flaky-{i:02d}" for i in range(20)]
    drill.proxy.reset_counts()
    t0 = time.monotonic()
    with faults(drill.proxy, flaky_api(namespace)), Sampler(drill, namespace) as sampler:
        # The operator's watches were opened before the faults: cut them, so that it
        # watches through the faults too.
        assert drill.proxy.cut_streams() >= len(WATCHED)
        apply_jobs(drill, namespace, names)
        jobs = wait_finished(drill, namespace, names, timeout=120)
    elapsed = time.monotonic() - t0
    injected = drill.proxy.injected()
    calls = drill.proxy.calls()
    requests = [r for r in calls if r.call.verb != "watch"]
    failed = [r for r in requests if r.fault not in (None, Fault.SLOW)]
    worst_job, worst_age = sampler.worst_age()
    report(
        "flaky API",
        jobs=len(names),
        seconds=f"{elapsed:.1f}",
        requests=len(requests),
        failed=f"{len(failed)} ({100 * len(failed) / max(1, len(requests)):.1f} %)",
        watches=len(calls) - len(requests),
        injected=faults_table(injected),
        max_reconcile_age=f"{worst_age:.1f}s ({worst_job})",
        scrapes=f"{sampler.scrapes - sampler.failed_scrapes}/{sampler.scrapes}",
    )
    assert {n: phase(jobs[n]) for n in names} == dict.fromkeys(names, "Succeeded")
    # Nothing failed on the trainer side: a fault of the API alone must not relaunch.
    assert {n: jobs[n]["status"].get("attempt") for n in names} == dict.fromkeys(names, 1)
    assert not sampler.duplicates(), f"attempts with two batch Jobs: {sampler.duplicates()}"
    assert {job for job, _ in sampler.batch_names} == set(names)
    # The drill only means something if the faults happened, each kind of them.
    for kind in Fault:
        assert injected[str(kind)] > 0, f"no {kind} injected: {faults_table(injected)}"
    assert 0.08 <= len(failed) / len(requests) <= 0.25, faults_table(injected)
    assert sampler.scrapes - sampler.failed_scrapes >= 10, sampler.scrapes
    assert sampler.max_age, "no unfinished job was ever seen in the operator's metrics"
    assert worst_age <= AGE_LIMIT_SECONDS, sampler.max_age


def test_operator_recovers_from_a_full_api_outage(drill: Drill, namespace: str) -> None:
    before = [f"before-{i}" for i in range(8)]
    during = [f"during-{i}" for i in range(4)]
    api = Api(drill.local)
    drill.proxy.reset_counts()
    apply_jobs(drill, namespace, before)
    wait_for(
        "three batch Jobs to exist", lambda: len(batch_jobs(api, namespace)) >= 3, 60, interval=0.2
    )
    at_start = dict(phases(api, namespace))
    out_at = time.time()
    drill.proxy.outage(OUTAGE_SECONDS)
    apply_jobs(drill, namespace, during)
    wait_for("the outage to end", lambda: not drill.proxy.down, OUTAGE_SECONDS + 10, interval=0.2)
    back_at = time.time()
    at_end = dict(phases(api, namespace))
    jobs = wait_finished(drill, namespace, before + during, timeout=120)
    done_at = time.time()
    api.close()
    writes = [
        r.at
        for r in drill.proxy.calls(verb="patch", resource=FTJ, since=back_at)
        if r.status == 200
    ]
    first_write = min(writes) - back_at if writes else float("nan")
    report(
        "outage",
        seconds=f"{back_at - out_at:.1f}",
        phases_at_start=at_start,
        phases_at_end=at_end,
        refused_on_open_connections=drill.proxy.injected()["refused"],
        first_status_write_after=f"{first_write:.1f}s",
        all_finished_after=f"{done_at - back_at:.1f}s",
    )
    assert process_alive(drill.pid), "the operator exited instead of riding out the outage"
    assert drill.local.state.pids.get("operator") == drill.pid, "the operator was restarted"
    names = before + during
    assert {n: phase(jobs[n]) for n in names} == dict.fromkeys(names, "Succeeded")
    assert at_start.get("Succeeded", 0) < len(before), "every job finished before the outage"
    assert writes, "no status write went through after the outage"


def test_jobs_finish_across_an_etcd_restart(drill: Drill, namespace: str) -> None:
    names = [f"etcd-{i}" for i in range(8)]
    api = Api(drill.local)
    drill.proxy.reset_counts()
    apply_jobs(drill, namespace, names)
    wait_for("a batch Job to exist", lambda: batch_jobs(api, namespace), 60, interval=0.2)
    at_stop = dict(phases(api, namespace))
    api.close()
    t0 = time.monotonic()
    assert drill.local.stop_component("etcd"), "etcd did not stop"
    time.sleep(ETCD_DOWN_SECONDS)
    drill.local.start_etcd()
    ready = time.monotonic() - t0
    jobs = wait_finished(drill, namespace, names, timeout=120)
    report(
        "etcd restart",
        phases_at_stop=at_stop,
        apiserver_ready_again_after=f"{ready:.1f}s",
        all_finished_after=f"{time.monotonic() - t0:.1f}s",
        operator_requests=len(drill.proxy.calls()),
    )
    assert process_alive(drill.pid)
    assert {n: phase(jobs[n]) for n in names} == dict.fromkeys(names, "Succeeded")
    assert at_stop.get("Succeeded", 0) < len(names), "every job finished before etcd stopped"


def writes_phase(call: Call) -> str | None:
    """The phase a status PATCH writes, if it writes one."""
    body = call.json() or {}
    value = (body.get("status") or {}).get("phase")
    return None if value is None else str(value)


@dataclass
class PhaseRefused:
    """A rule predicate: every write of `phase` is refused, from the first one until
    `seconds` after it."""

    phase: str
    seconds: float
    first: float | None = None

    def __call__(self, call: Call) -> bool:
        if writes_phase(call) != self.phase:
            return False
        now = time.monotonic()
        if self.first is None:
            self.first = now
        return now - self.first < self.seconds


def refuse(namespace: str, name: str, **how: Any) -> Rule:
    """422 on status writes of one job."""
    return rule(
        Fault.INVALID, verbs=["patch"], resources=[FTJ], namespaces=[namespace], names=[name], **how
    )


def test_a_rejected_status_write_does_not_stop_a_job(drill: Drill, namespace: str) -> None:
    """`first-write`: the job's first status write (its plan) gets one 422.

    `last-write` and `unplannable`: the write that records the end (Succeeded; Failed for a
    job that fits no pool) is refused for REFUSED_SECONDS, every attempt. By then the
    job's children have long stopped changing (the unplannable job has none), so only the
    operator's own retry can record the end: no late event of a pod or batch Job wakes it.
    """
    jobs_docs = [
        job_doc("first-write"),
        job_doc("last-write"),
        job_doc(
            "unplannable",
            model={"uri": "meta-llama/Llama-3.1-405B"},
            method="full",
            resources={"gpus": 1},
        ),
    ]
    ends = {"first-write": "Succeeded", "last-write": "Succeeded", "unplannable": "Failed"}
    rules = [
        refuse(namespace, "first-write", limit=1),
        refuse(namespace, "last-write", when=PhaseRefused("Succeeded", REFUSED_SECONDS)),
        refuse(namespace, "unplannable", when=PhaseRefused("Failed", REFUSED_SECONDS)),
    ]
    drill.proxy.reset_counts()
    with faults(drill.proxy, rules):
        out = drill.cluster.apply(*jobs_docs, namespace=namespace)
        assert out.returncode == 0, out.stderr
        jobs = wait_finished(drill, namespace, ends, timeout=60)
    events = drill.cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "reason=StatusRejected", "-o", "json"
    ).stdout
    warned = Counter(e["involvedObject"]["name"] for e in json.loads(events)["items"])
    for name, end in ends.items():
        patches = status_patches(drill.proxy, namespace, name)
        rejected = [r for r in patches if r.fault is Fault.INVALID]
        assert rejected, f"{name}: no 422 injected"
        later = [r for r in patches if r.at > rejected[-1].at and r.status == 200]
        report(
            f"422 on {name}",
            status_patches=len(patches),
            rejected=len(rejected),
            accepted_after_the_last_422=len(later),
            phase=phase(jobs[name]),
        )
        assert later, f"{name}: no status write after the rejected one"
        assert phase(jobs[name]) == end
        assert warned[name] >= 1, f"{name}: no StatusRejected Warning event"
        if name == "first-write":
            assert len(rejected) == 1 and len(later) >= 2, "it went on getting status writes"
        else:
            ended = [r for r in later if writes_phase(r.call) == end]
            assert ended, f"{name}: {end} was recorded by a write after the refusals"
