"""What the CLI reads from a cluster, through the user's kubeconfig: the jobs and pools of
`kubetune get`, `describe`, `pools` and `plan --from-cluster`, and `kubetune check`.

`kubetune check` is what the chart's `helm test` pod runs (and what a platform engineer
runs by hand): the CRDs are served (Established), and the operator answers on its metrics
endpoint with its `kubetune_operator_info`. Each finding is a line; any failure says what
to look at.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx2
from lightkube import Client, KubeConfig
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.core_v1 import Event
from pydantic import ValidationError

from kubetune.api.v1alpha1 import GROUP, GPUPool
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
        selector: dict[str, Any] = {
            "involvedObject.name": name,
            "involvedObject.kind": "FineTuneJob",
        }
        events = [e.to_dict() for e in api.list(Event, namespace=where, fields=selector)]
        return job, events


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
