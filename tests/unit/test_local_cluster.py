"""LocalCluster's helpers that need no running control plane: kubeconfigs, etcd restarts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from lightkube import KubeConfig

from kubetune_dev.binaries import Binaries
from kubetune_dev.cluster import ClusterError, LocalCluster, State

pytestmark = pytest.mark.unit


def local(root: Path) -> LocalCluster:
    tool = root / "bin/tool"
    binaries = Binaries(tool, tool, tool, tool, tool, tool, tool, "v0")
    return LocalCluster(root, binaries)


def test_kubeconfig_for_plain_http_carries_no_tls_material(tmp_path: Path) -> None:
    path = local(tmp_path).kubeconfig_for("http://127.0.0.1:18080", "proxy")
    assert path == tmp_path / "proxy.kubeconfig"
    config = yaml.safe_load(path.read_text())
    assert config["clusters"][0]["cluster"] == {"server": "http://127.0.0.1:18080"}
    assert config["users"][0]["user"] == {}
    # The operator's client reads it: the server, and no credentials to find.
    single = KubeConfig.from_file(path).get()
    assert single.cluster.server == "http://127.0.0.1:18080"
    assert single.user is not None and single.user.client_cert is None


def test_kubeconfig_for_https_names_the_ca_and_the_admin_certificate(tmp_path: Path) -> None:
    cluster = local(tmp_path)
    config = yaml.safe_load(cluster.kubeconfig_for("https://127.0.0.1:6443", "other").read_text())
    assert config["clusters"][0]["cluster"] == {
        "server": "https://127.0.0.1:6443",
        "certificate-authority": str(cluster.pki.ca_cert),
    }
    cert, key = cluster.pki.client("admin")
    assert config["users"][0]["user"] == {"client-certificate": str(cert), "client-key": str(key)}


def test_start_etcd_refuses_while_etcd_runs(tmp_path: Path) -> None:
    cluster = local(tmp_path)
    cluster.state = State(root=str(tmp_path), pids={"etcd": os.getpid()})
    with pytest.raises(ClusterError, match="etcd is running"):
        cluster.start_etcd()


def test_state_without_an_etcd_peer_port_still_loads(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text(json.dumps({"root": str(tmp_path), "etcd_port": 5}))
    state = State.load(tmp_path)
    assert state is not None and (state.etcd_port, state.etcd_peer_port) == (5, 0)
