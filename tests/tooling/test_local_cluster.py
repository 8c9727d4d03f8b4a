"""LocalCluster without a running control plane: kubeconfigs, etcd restarts, and the command
lines it starts kwok and kube-apiserver with."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from lightkube import KubeConfig

from kubetune_dev.binaries import Binaries
from kubetune_dev.cluster import ClusterError, LocalCluster, State

pytestmark = pytest.mark.tooling


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


SPAWNER = """
import sys, time
from pathlib import Path
from kubetune_dev.binaries import Binaries
from kubetune_dev.cluster import LocalCluster

root = Path(sys.argv[1])
tool = root / "bin/tool"
cluster = LocalCluster(root, Binaries(*[tool] * 7, "v0"), die_with_caller=sys.argv[2] == "tied")
cluster.logs.mkdir(parents=True)
cluster._spawn("sleeper", ["sleep", "300"])
print(cluster.state.pids["sleeper"], flush=True)
time.sleep(300)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever adopted it to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="no util-linux setpriv here")
@pytest.mark.parametrize("tied,late", [(True, False), (True, True), (False, False)])
def test_components_die_with_a_caller_killed_outright_when_tied(
    tmp_path: Path, tied: bool, late: bool
) -> None:
    """A test run stopped by SIGKILL never reaches its teardown: tied components still go, even
    when the caller dies before the death signal is set (`late`: a setpriv that starts slowly)."""
    env = dict(os.environ)
    if late:
        slow = tmp_path / "slow-bin"
        slow.mkdir()
        real = shutil.which("setpriv")
        (slow / "setpriv").write_text(f'#!/bin/sh\nsleep 0.5\nexec {real} "$@"\n')
        (slow / "setpriv").chmod(0o755)
        env["PATH"] = f"{slow}:{env.get('PATH', '')}"
    caller = subprocess.Popen(
        [sys.executable, "-c", SPAWNER, str(tmp_path), "tied" if tied else "free"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert caller.stdout is not None
    component = int(caller.stdout.readline())
    try:
        caller.kill()
        caller.wait(timeout=10)
        deadline = time.monotonic() + (10 if tied else 1)  # a free one is given 1 s to go
        while running(component) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(component) is not tied
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(component, signal.SIGKILL)


def test_a_sized_volume_is_a_tmpfs_of_the_claims_request(tmp_path: Path) -> None:
    """The local provisioner's `kubetune-local-sized` class: a file system that really fills
    up at the claim's size (the e2e disk-full drill), unmounted when the volume goes."""
    from kubetune_dev.provisioner import _mount_tmpfs, _remove, tmpfs_size

    assert [tmpfs_size(q) for q in ("64Mi", "2Gi", "512Ki", "1048576")] == [
        "64m",
        "2g",
        "512k",
        "1048576",
    ]
    with pytest.raises(ValueError, match="whole Ki/Mi/Gi"):
        tmpfs_size("1.5Gi")
    folder = tmp_path / "pvc-1"
    folder.mkdir()
    try:
        _mount_tmpfs(folder, "1Mi")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc.stderr.strip()}")
    try:
        assert os.path.ismount(folder)
        with pytest.raises(OSError, match="No space left"):
            (folder / "fill").write_bytes(bytes(2 * 2**20))
    finally:
        _remove(folder)
    assert not folder.exists()
