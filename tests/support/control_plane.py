"""The control plane's fixtures, a pytest plugin of tests/conftest.py: a real control plane
on loopback and the operator, for every tier whose tests start one (integration, and the
tooling tests marked `controlplane`).

The cluster (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok with
simulated GPU pools, a hostPath provisioner) starts once per session (once per pytest-xdist
worker), on a test's first use; every test gets a fresh namespace, which enforces the
`restricted` Pod Security Standard. The operator runs as a separate `kopf run` process, as
users run it. Component and operator logs are printed when a test fails.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

if TYPE_CHECKING:
    from kubetune_dev.binaries import Binaries
    from kubetune_dev.cluster import LocalCluster
    from support.cluster import Cluster


@pytest.fixture(scope="session")
def local_cluster(
    tmp_path_factory: pytest.TempPathFactory, binaries: Binaries
) -> Iterator[LocalCluster]:
    from kubetune.api.crdgen import render_all
    from kubetune_dev.cli import simulated_pool_docs
    from kubetune_dev.cluster import LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), binaries, die_with_caller=True)
    t0 = time.monotonic()
    cluster.start()
    cluster.apply([yaml.safe_load(text) for text in render_all().values()])
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=30s")
    cluster.add_simulated_pools(simulated_pool_docs())
    print(f"\nlocal cluster ready in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    yield cluster
    left = cluster.stop()
    assert not left, f"processes survived shutdown: {left}"


@pytest.fixture(scope="session")
def cluster(local_cluster: LocalCluster) -> Cluster:
    from support.cluster import Cluster

    return Cluster(local_cluster)


@pytest.fixture(scope="session")
def operator(local_cluster: LocalCluster) -> Iterator[Path]:
    """The operator as its own process, polling fast so tests are quick."""
    from support.cluster import FAST_OPERATOR, start_operator

    start_operator(local_cluster, FAST_OPERATOR)
    yield local_cluster.logs / "operator.log"
    assert local_cluster.stop_component("operator"), "the operator did not stop"


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace that enforces the `restricted` Pod Security Standard: trainer pods
    and the tests' own pods there must be restricted-compliant (support/podsecurity.py)."""
    from support.podsecurity import restricted_namespace

    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(restricted_namespace(name)))
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if (
        report.when == "call"
        and report.failed
        and "local_cluster" in getattr(item, "fixturenames", ())
    ):
        local: LocalCluster = item.funcargs.get("local_cluster") or item._request.getfixturevalue(
            "local_cluster"
        )  # type: ignore[attr-defined]
        replicas = sorted(p.stem for p in local.logs.glob("operator-*.log"))
        for name in (
            "operator",
            *replicas,
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
            "provisioner",
        ):
            report.sections.append((f"{name} log (tail)", local.log_tail(name, 40)))
