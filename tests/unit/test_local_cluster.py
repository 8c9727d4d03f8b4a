"""The command lines LocalCluster starts kwok and kube-apiserver with (nothing is started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetune_dev.binaries import Binaries
from kubetune_dev.cluster import ClusterError, LocalCluster

pytestmark = pytest.mark.unit


def _binaries(tmp_path: Path) -> Binaries:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    names = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
    paths = {name: bin_dir / name for name in (*names, "kubectl", "kwok", "helm")}
    return Binaries(
        etcd=paths["etcd"],
        kube_apiserver=paths["kube-apiserver"],
        kube_controller_manager=paths["kube-controller-manager"],
        kube_scheduler=paths["kube-scheduler"],
        kubectl=paths["kubectl"],
        kwok=paths["kwok"],
        helm=paths["helm"],
        version="v1.37.1",
    )


def _configs(argv: list[str]) -> list[str]:
    return [arg for arg in argv if arg.startswith("--config=")]


def test_kwok_uses_the_stages_next_to_its_binary_by_default(tmp_path: Path) -> None:
    bins = _binaries(tmp_path)
    cluster = LocalCluster(tmp_path / "root", bins)
    assert _configs(cluster.kwok_argv()) == [], "no stage file there: no --config"
    bins.kwok_stages.write_text("kind: Stage\n")
    argv = cluster.kwok_argv()
    assert argv[0] == str(bins.kwok)
    assert _configs(argv) == [f"--config={bins.kwok_stages}"]


def test_kwok_stages_and_args_replace_and_extend_the_defaults(tmp_path: Path) -> None:
    bins = _binaries(tmp_path)
    bins.kwok_stages.write_text("kind: Stage\n")
    own = tmp_path / "stages.yaml"
    own.write_text("kind: Stage\n")
    cluster = LocalCluster(
        tmp_path / "root", bins, kwok_stages=own, kwok_args=["--cidr=127.16.0.0/12"]
    )
    argv = cluster.kwok_argv()
    assert _configs(argv) == [f"--config={own}"]
    assert argv[-1] == "--cidr=127.16.0.0/12"
    assert "--manage-all-nodes=false" in argv


def test_a_missing_kwok_stage_file_is_an_error_that_says_what_to_do(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    cluster = LocalCluster(tmp_path / "root", _binaries(tmp_path), kwok_stages=missing)
    with pytest.raises(ClusterError, match=r"nope\.yaml does not exist; to fix"):
        cluster.kwok_argv()


def test_apiserver_args_come_last_so_they_win(tmp_path: Path) -> None:
    bins = _binaries(tmp_path)
    plain = LocalCluster(tmp_path / "a", bins).apiserver_argv()
    extra = ["--max-requests-inflight=800", "--v=2"]
    argv = LocalCluster(tmp_path / "b", bins, apiserver_args=extra).apiserver_argv()
    assert plain[0] == str(bins.kube_apiserver)
    assert "--v=1" in plain and not any("max-requests-inflight" in a for a in plain)
    # Go's flag parsing keeps the last value of a repeated flag: the extra --v=2 wins.
    assert argv[-2:] == extra
    assert len(argv) == len(plain) + len(extra)


def test_controller_manager_args_extend_the_controller_list(tmp_path: Path) -> None:
    bins = _binaries(tmp_path)
    off = "--controllers=-endpoints-controller,-endpointslice-controller"
    argv = LocalCluster(
        tmp_path / "r", bins, controller_manager_args=[off]
    ).controller_manager_argv()
    assert argv[0] == str(bins.kube_controller_manager)
    # pflag appends a repeated list flag: node IPAM stays off and the endpoint controllers join it.
    assert [a for a in argv if a.startswith("--controllers=")] == [
        "--controllers=*,-node-ipam-controller",
        off,
    ]
    assert argv[-1] == off
