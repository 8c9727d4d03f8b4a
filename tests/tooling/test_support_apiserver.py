"""The tests' REST reads (support/apiserver.py) name the paths the API server serves: the
kubetune kinds as the CRDs declare them, and a read as kubectl would make it."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kubetune.api.crdgen import render_all
from support.apiserver import RESOURCES, Resource

pytestmark = pytest.mark.tooling


def _crds() -> list[dict[str, Any]]:
    return [yaml.safe_load(text) for text in render_all().values()]


@pytest.mark.parametrize("crd", _crds(), ids=lambda crd: crd["metadata"]["name"])
def test_every_name_kubectl_takes_for_a_kubetune_kind_reads_its_crd(crd: dict[str, Any]) -> None:
    spec, names = crd["spec"], crd["spec"]["names"]
    version = next(v["name"] for v in spec["versions"] if v["storage"])
    want = Resource(
        f"/apis/{spec['group']}/{version}", names["plural"], spec["scope"] == "Namespaced"
    )
    for name in [
        names["plural"],
        names["singular"],
        *names["shortNames"],
        f"{names['singular']}.{spec['group']}",
    ]:
        assert RESOURCES.get(name) == want, name


def test_paths_of_namespaced_and_cluster_scoped_reads() -> None:
    assert (
        RESOURCES["pvc"].path("e2e", "data") == "/api/v1/namespaces/e2e/persistentvolumeclaims/data"
    )
    # kubectl ignores -n for a cluster-scoped kind; a list without a namespace is all of them.
    assert RESOURCES["pv"].path("e2e", "pv-1") == "/api/v1/persistentvolumes/pv-1"
    assert RESOURCES["job.batch"].path(None) == "/apis/batch/v1/jobs"
    assert (
        RESOURCES["ftj"].path("a b", "x")
        == "/apis/kubetune.io/v1alpha1/namespaces/a%20b/finetunejobs/x"
    )
