"""`kubetune check`: is kubetune installed and working in this cluster?

What the chart's `helm test` pod runs (and what a platform engineer runs by hand): the
CRDs are served (Established), and the operator answers on its metrics endpoint with its
`kubetune_operator_info`. Each finding is a line; any failure says what to look at.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx2

from kubetune.api.v1alpha1 import GROUP

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


def run_checks(operator_url: str | None, timeout: float) -> list[Finding]:
    """Check the CRDs through the current kubeconfig (or in-cluster account), then the
    operator when a URL is given."""
    from lightkube import Client
    from lightkube.resources.apiextensions_v1 import CustomResourceDefinition

    client = Client(timeout=httpx2.Timeout(timeout))
    try:
        crds = [c.to_dict() for c in client.list(CustomResourceDefinition)]
    finally:
        client.close()
    findings = check_crds(crds)
    if operator_url:
        with httpx2.Client(timeout=timeout) as http:
            findings.append(check_operator(operator_url, http.get))
    return findings
