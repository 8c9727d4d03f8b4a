"""What the CLI reads from a cluster, through the user's kubeconfig: the jobs and pools of
`kubetune get`, `describe`, `pools` and `plan --from-cluster`, a job followed by `watch`,
the trainer pods' logs of `logs`, and `kubetune check`.

`kubetune check` is what the chart's `helm test` pod runs (and what a platform engineer
runs by hand): the CRDs are served (Established), and the operator answers on its metrics
endpoint with its `kubetune_operator_info`. Each finding is a line; any failure says what
to look at.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx2
from lightkube import ApiError, Client, KubeConfig
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.core_v1 import Event, Namespace, Pod
from pydantic import ValidationError

from kubetune.api.tenancy import Tenant
from kubetune.api.v1alpha1 import GROUP, GPUPool
from kubetune.api.vocabulary import JOB_NAME_LABEL, LABEL_ATTEMPT, LABEL_JOB
from kubetune.cli.follow import LogSource, ObjectWatcher, Watcher, outcome
from kubetune.control.build.names import child_names, label_value
from kubetune.control.build.trainer import CONTAINER_NAME
from kubetune.controller.kube import FineTuneJobResource, GPUPoolResource

CRDS = (f"finetunejobs.{GROUP}", f"gpupools.{GROUP}")
OPERATOR_METRIC = "kubetune_operator_info"


@dataclass(frozen=True)
class Finding:
    ok: bool
    what: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.what}"


def check_crds(crds: Iterable[Mapping[str, Any]]) -> list[Finding]:
    """One finding per kubetune CRD: present and Established."""
    served = {str(c.get("metadata", {}).get("name")): c for c in crds}
    findings = []
    for name in CRDS:
        crd = served.get(name)
        if crd is None:
            findings.append(
                Finding(False, f"CRD {name} is missing: install the chart (or `kubetune crds`)")
            )
            continue
        conditions = {c.get("type"): c for c in (crd.get("status") or {}).get("conditions") or []}
        established = conditions.get("Established") or {}
        if established.get("status") == "True":
            findings.append(Finding(True, f"CRD {name} is established"))
        else:
            why = established.get("message") or "no Established condition yet"
            findings.append(Finding(False, f"CRD {name} is not established: {why}"))
    return findings


def check_operator(url: str, get: Callable[[str], httpx2.Response]) -> Finding:
    """The operator's metrics endpoint answers and names itself."""
    try:
        answer = get(url)
    except httpx2.HTTPError as exc:
        return Finding(
            False,
            f"the operator does not answer at {url} ({exc}): check its Deployment's pods, "
            "their Events and log, and the metrics Service",
        )
    if answer.status_code != 200:
        return Finding(False, f"the operator answered {answer.status_code} at {url}")
    for line in answer.text.splitlines():
        if line.startswith(OPERATOR_METRIC + "{"):
            version = line.split('version="', 1)[-1].split('"', 1)[0]
            return Finding(True, f"the operator answers at {url} (version {version})")
    return Finding(False, f"{url} answered, but without {OPERATOR_METRIC}: is it kubetune's?")


def client(timeout: float, kubeconfig: str | None = None, context: str | None = None) -> Client:
    """A client for the CLI: `kubeconfig` (default: $KUBECONFIG, ~/.kube/config, or the
    pod's service account) and its `context` (default: the current one)."""
    if kubeconfig is None and context is None:
        return Client(timeout=httpx2.Timeout(timeout))
    config = KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_env()
    return Client(config=config.get(context_name=context), timeout=httpx2.Timeout(timeout))


def pool_objects(
    timeout: float, kubeconfig: str | None = None, context: str | None = None
) -> list[dict[str, Any]]:
    """The cluster's GPUPools as the API server returns them."""
    with client(timeout, kubeconfig, context) as api:
        return [obj.to_dict() for obj in api.list(GPUPoolResource)]  # type: ignore[no-untyped-call]


def cluster_pools(
    timeout: float, kubeconfig: str | None = None, context: str | None = None
) -> tuple[list[GPUPool], list[str]]:
    """The cluster's GPUPools with their status (live capacity), and a line for each one
    that cannot be read."""
    objects = pool_objects(timeout, kubeconfig, context)
    pools, unreadable = [], []
    for obj in objects:
        try:
            pools.append(GPUPool.model_validate(obj))
        except ValidationError as exc:
            name = (obj.get("metadata") or {}).get("name")
            unreadable.append(f"GPUPool {name} cannot be read: {exc.errors()[0]['msg']}")
    return pools, unreadable


def cluster_tenant(
    timeout: float,
    kubeconfig: str | None = None,
    context: str | None = None,
    namespace: str | None = None,
) -> Tenant:
    """What `namespace` (default: the context's, else `default`) allows its jobs: its
    labels (which pools take it) and the Secrets its owner allowed."""
    with client(timeout, kubeconfig, context) as api:
        where = namespace or api.namespace or "default"
        meta = api.get(Namespace, where).to_dict()["metadata"]
        return Tenant.of(where, meta.get("labels") or {}, meta.get("annotations") or {})


def cluster_jobs(
    timeout: float,
    kubeconfig: str | None = None,
    context: str | None = None,
    namespace: str | None = None,
    all_namespaces: bool = False,
) -> tuple[list[dict[str, Any]], str]:
    """The FineTuneJobs of `namespace` (default: the context's, else `default`) or of every
    namespace, as the API server returns them; and the namespace read ("*" for all)."""
    with client(timeout, kubeconfig, context) as api:
        where = "*" if all_namespaces else (namespace or api.namespace or "default")
        listed = api.list(FineTuneJobResource, namespace=where)
        return [obj.to_dict() for obj in listed], where  # type: ignore[no-untyped-call]


def job_with_events(
    timeout: float,
    name: str,
    kubeconfig: str | None = None,
    context: str | None = None,
    namespace: str | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One FineTuneJob as the API server returns it, and the Events about it."""
    with client(timeout, kubeconfig, context) as api:
        where = namespace or api.namespace or "default"
        job = api.get(FineTuneJobResource, name, namespace=where).to_dict()  # type: ignore[no-untyped-call]
        return job, events_about(api, name, where, job["metadata"].get("uid"))


def run_checks(operator_url: str | None, timeout: float) -> list[Finding]:
    """Check the CRDs through the current kubeconfig (or in-cluster account), then the
    operator when a URL is given."""
    with client(timeout) as api:
        crds = [c.to_dict() for c in api.list(CustomResourceDefinition)]
    findings = check_crds(crds)
    if operator_url:
        with httpx2.Client(timeout=timeout) as http:
            findings.append(check_operator(operator_url, http.get))
    return findings


def events_about(
    api: Client, name: str, namespace: str, uid: str | None = None
) -> list[dict[str, Any]]:
    """The Events about one FineTuneJob: this object's (`uid`), not those of an earlier job
    of the same name, whose Events outlive it."""
    selector: dict[str, Any] = {"involvedObject.name": name, "involvedObject.kind": "FineTuneJob"}
    if uid:
        selector["involvedObject.uid"] = uid
    return [e.to_dict() for e in api.list(Event, namespace=namespace, fields=selector)]


def watch_job(
    api: Client,
    name: str,
    namespace: str,
    emit: Callable[[str], None],
    interval: float,
    deadline: float | None = None,
    watcher: Watcher | ObjectWatcher | None = None,
) -> dict[str, Any] | None:
    """Print (`emit`) a job's plan, progress and Events as they change (or, with an
    ObjectWatcher, the object itself), looking every `interval` seconds, until it finishes;
    returns it then, or None when `deadline` (monotonic) passes first."""
    watcher = watcher or Watcher()
    while True:
        job = api.get(FineTuneJobResource, name, namespace=namespace).to_dict()  # type: ignore[no-untyped-call]
        events = events_about(api, name, namespace, job["metadata"].get("uid"))
        for line in watcher.update(job, events):
            emit(line)
        if outcome(job) is not None:
            return dict(job)
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def trainer_pods(api: Client, name: str, namespace: str, attempt: int) -> list[dict[str, Any]]:
    """The trainer pods of one attempt of a FineTuneJob (selected by the labels the operator
    puts on them, which stay under 63 characters for long job names)."""
    selector: dict[str, Any] = {LABEL_JOB: label_value(name), LABEL_ATTEMPT: str(attempt)}
    batch_job = child_names(name, attempt).job
    pods = [p.to_dict() for p in api.list(Pod, namespace=namespace, labels=selector)]
    # A shortened label value could be shared by two long names: the batch Job tells.
    return [p for p in pods if _batch_job_of(p) == batch_job]


def _batch_job_of(pod: Mapping[str, Any]) -> str | None:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(JOB_NAME_LABEL) or labels.get("job-name")  # the older label


def stream_logs(
    api: Client,
    namespace: str,
    sources: Sequence[LogSource],
    emit: Callable[[str], None],
    follow: bool = False,
    tail: int | None = None,
) -> list[str]:
    """Print (`emit`) the trainer's log lines of each source: one pod after the other, or,
    when following, all at once as lines arrive. Returns a line for each pod whose log could
    not be read."""
    problems: list[str] = []

    def read(source: LogSource, sink: Callable[[str], None]) -> None:
        try:
            for line in api.log(
                source.pod,
                namespace=namespace,
                container=CONTAINER_NAME,
                follow=follow,
                tail_lines=tail,
                newlines=False,
            ):
                if source.keep(line):
                    sink(source.prefix + line)
        except ApiError as exc:
            problems.append(f"pod {source.pod}: {exc.status.message}")
        except httpx2.HTTPError as exc:
            problems.append(f"pod {source.pod}: {exc}")

    if not follow:
        for source in sources:
            read(source, emit)
        return problems
    lines: queue.Queue[str | None] = queue.Queue()

    def follow_one(source: LogSource) -> None:
        try:
            read(source, lines.put)
        finally:
            lines.put(None)  # this pod's log ended

    for source in sources:
        threading.Thread(target=follow_one, args=(source,), daemon=True).start()
    open_logs = len(sources)
    while open_logs:
        item = lines.get()
        if item is None:
            open_logs -= 1
        else:
            emit(item)
    return problems
