"""`kubetune check` (cli/readers.py): what each finding says, from CRD objects and an
operator's answer; tests/integration/test_helm.py runs it against a real install."""

from __future__ import annotations

from typing import Any

import httpx2

from kubetune.cli.readers import CRDS, check_crds, check_operator

URL = "http://kubetune-metrics.ns.svc:8000/metrics"


def crd(name: str, established: str | None = "True", message: str = "") -> dict[str, Any]:
    conditions = [] if established is None else [
        {"type": "Established", "status": established, "message": message}
    ]  # fmt: skip
    return {"metadata": {"name": name}, "status": {"conditions": conditions}}


def test_established_crds_pass() -> None:
    findings = check_crds([crd(n) for n in CRDS] + [crd("other.example.com", "False")])
    assert [f.line() for f in findings] == [
        "ok   CRD finetunejobs.kubetune.io is established",
        "ok   CRD gpupools.kubetune.io is established",
    ]


def test_a_missing_or_unestablished_crd_fails_and_says_why() -> None:
    findings = check_crds([crd(CRDS[1], "False", "the names are not accepted")])
    assert [f.ok for f in findings] == [False, False]
    assert "finetunejobs.kubetune.io is missing: install the chart" in findings[0].what
    assert findings[1].what.endswith("not established: the names are not accepted")
    assert "no Established condition yet" in check_crds([crd(CRDS[0], None)])[0].what


def answer(status: int, text: str) -> httpx2.Response:
    return httpx2.Response(status, text=text)


def test_the_operator_answers_with_its_version() -> None:
    body = '# HELP x\nkubetune_operator_info{version="0.2.0"} 1.0\n'
    finding = check_operator(URL, lambda url: answer(200, body))
    assert finding.ok
    assert finding.what == f"the operator answers at {URL} (version 0.2.0)"


def test_no_answer_a_wrong_answer_or_another_program_fail() -> None:
    def refused(url: str) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused")

    down = check_operator(URL, refused)
    assert not down.ok and "does not answer" in down.what and "Deployment" in down.what
    assert check_operator(URL, lambda url: answer(503, "")).what.endswith(f"503 at {URL}")
    other = check_operator(URL, lambda url: answer(200, "up 1\n"))
    assert not other.ok and "without kubetune_operator_info" in other.what
