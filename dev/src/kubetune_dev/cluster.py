"""A real Kubernetes control plane on loopback, for tests and the local demo.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler run as plain processes on
127.0.0.1 with a generated PKI; kwok plays the kubelet of simulated GPU nodes; a small
provisioner binds PVCs to hostPath volumes. Everything lives under one folder (`root`):
certificates, kubeconfig, etcd data, volumes, component logs and a `state.json` that lets
another process (`kubetune dev status|down`) find and stop what `dev up` started.

This is test and demo infrastructure, not part of the product.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kubetune_dev.binaries import Binaries
from kubetune_dev.pki import Pki, create_pki
from kubetune_dev.provisioner import SIZED_SUFFIX, unmount_volumes

Progress = Callable[[str], None]

SERVICE_CIDR = "10.96.0.0/16"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
STORAGE_CLASS = "kubetune-local"
ADMIN = "admin"
# Run under `setpriv --pdeathsig`: exec the component unless the caller ($1) died first.
_TIED = 'test "$PPID" = "$1" || exit 143; shift; exec "$@"'
CLIENTS: dict[str, tuple[str, str | None]] = {
    ADMIN: ("kubetune-admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "scheduler": ("system:kube-scheduler", None),
    "kwok": ("kwok-controller", "system:masters"),
    "provisioner": ("kubetune-local-provisioner", "system:masters"),
    "podrunner": ("kubetune-podrunner", "system:masters"),
}


class ClusterError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_root(name: str = "default") -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kubetune" / "dev" / name


@dataclass
class State:
    """What a running cluster needs others to know; persisted as state.json."""

    root: str
    apiserver_port: int = 0
    etcd_port: int = 0
    etcd_peer_port: int = 0
    pids: dict[str, int] = field(default_factory=dict)
    started_at: float = 0.0

    @classmethod
    def load(cls, root: Path) -> State | None:
        path = root / "state.json"
        if not path.exists():
            return None
        return cls(**json.loads(path.read_text()))

    def save(self) -> None:
        path = Path(self.root) / "state.json"
        path.write_text(json.dumps(self.__dict__, indent=2))


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child counts as gone.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    return True


STOP_ORDER = (
    "operator",
    "podrunner",
    "provisioner",
    "kwok",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "etcd",
)


def stop_processes(state: State, timeout_s: float = 15.0, save: bool = True) -> list[str]:
    """SIGTERM each process group (dependents first), SIGKILL what is left after the timeout."""
    # Extra pod runners (`podrunner-<node>`) stop with the first one, before the API server.
    rank = {n: i for i, n in enumerate(STOP_ORDER)}
    names = sorted(
        state.pids,
        key=lambda n: rank.get("podrunner" if n.startswith("podrunner-") else n, len(rank)),
    )
    for name in names:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(state.pids[name], signal.SIGTERM)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(process_alive(state.pids[n]) for n in names):
        time.sleep(0.1)
    for name in names:
        if process_alive(state.pids[name]):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(state.pids[name], signal.SIGKILL)
    end = time.monotonic() + 5
    while time.monotonic() < end and any(process_alive(state.pids[n]) for n in names):
        time.sleep(0.1)
    left = [n for n in names if process_alive(state.pids[n])]
    state.pids = {n: state.pids[n] for n in left}
    if save and (Path(state.root) / "state.json").exists():
        state.save()
    return left


def _write_kubeconfig(path: Path, server: str, pki: Pki, user: str) -> None:
    """A kubeconfig for `server` as `user`: the cluster CA and the user's client certificate
    for https; no TLS material at all for plain http (e.g. a local proxy that holds them)."""
    cluster: dict[str, str] = {"server": server}
    credentials: dict[str, str] = {}
    if not server.startswith("http://"):
        cert, key = pki.client(user)
        cluster["certificate-authority"] = str(pki.ca_cert)
        credentials = {"client-certificate": str(cert), "client-key": str(key)}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kubetune-local", "cluster": cluster}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [
            {"name": "kubetune-local", "context": {"cluster": "kubetune-local", "user": user}}
        ],
        "current-context": "kubetune-local",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


class LocalCluster:
    """Start, inspect and stop the local control plane rooted at `root`."""

    def __init__(
        self,
        root: Path,
        binaries: Binaries,
        progress: Progress | None = None,
        *,
        kwok_stages: Path | None = None,
        kwok_args: Sequence[str] = (),
        apiserver_args: Sequence[str] = (),
        controller_manager_args: Sequence[str] = (),
        scheduler_config: Mapping[str, Any] | None = None,
        die_with_caller: bool = False,
    ) -> None:
        """`kwok_stages` replaces the Stage objects kwok runs (default: the release's "fast"
        set next to the kwok binary). `kwok_args`, `apiserver_args` and
        `controller_manager_args` are appended to those components' command lines: a flag
        given there wins over the default one, and a list flag such as `--controllers`
        extends it (`--controllers=-endpoints-controller` turns one more controller off).
        `scheduler_config` is a KubeSchedulerConfiguration (kubescheduler.config.k8s.io/v1)
        for kube-scheduler, e.g. its profiles and client rate limits; the connection's
        kubeconfig and leader election are filled in here.

        `die_with_caller` ties every component to the thread that starts it (the kernel's
        parent-death signal, set by util-linux `setpriv`): they get SIGTERM when it dies,
        even by SIGKILL, so a test run or benchmark stopped before its teardown leaves no
        control plane behind. Only for a caller that starts components from a thread that
        lives as long as the cluster should (a test session's main thread); `kubetune dev
        up` leaves it off, its cluster outliving the command."""
        self.root = root
        self.binaries = binaries
        self.progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.kwok_stages = kwok_stages
        self.kwok_args = tuple(kwok_args)
        self.apiserver_args = tuple(apiserver_args)
        self.controller_manager_args = tuple(controller_manager_args)
        self.scheduler_config = None if scheduler_config is None else dict(scheduler_config)
        self.die_with_caller = die_with_caller
        self.pki = Pki(root / "pki")
        self.logs = root / "logs"
        self.kubeconfig = root / "kubeconfig"
        self.volumes = root / "volumes"
        self.state = State(root=str(root))
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        """Each component this object started, to read its exit status (`poll()`)."""

    # ------------------------------------------------------------------ paths

    def component_kubeconfig(self, user: str) -> Path:
        return self.root / f"{user}.kubeconfig"

    def kubeconfig_for(self, server: str, name: str) -> Path:
        """Write `<root>/<name>.kubeconfig` for another `server` in front of this cluster's
        apiserver (say, a proxy) as the admin user; plain http gets no TLS material."""
        path = self.root / f"{name}.kubeconfig"
        _write_kubeconfig(path, server, self.pki, ADMIN)
        return path

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.state.apiserver_port}"

    def env(self) -> dict[str, str]:
        """Environment for a process that should talk to this cluster."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.binaries.kubectl.parent}{os.pathsep}{env.get('PATH', '')}"
        return env

    # ------------------------------------------------------------------ start / stop

    def start(self, timeout_s: float = 90.0) -> None:
        existing = State.load(self.root)
        if existing and any(process_alive(p) for p in existing.pids.values()):
            raise ClusterError(
                f"a cluster is already running from {self.root} "
                f"(pids {sorted(existing.pids.values())}); stop it with `kubetune dev down`"
            )
        t0 = time.monotonic()
        if self.root.exists():
            unmount_volumes(self.volumes)
            shutil.rmtree(self.root)
        for d in (self.logs, self.volumes, self.root / "etcd"):
            d.mkdir(parents=True, exist_ok=True)
        create_pki(self.pki.dir, CLIENTS)
        self.state = State(
            root=str(self.root),
            apiserver_port=free_port(),
            etcd_port=free_port(),
            etcd_peer_port=free_port(),
            started_at=time.time(),
        )
        _write_kubeconfig(self.kubeconfig, self.server, self.pki, ADMIN)
        for user in CLIENTS:
            if user != ADMIN:
                _write_kubeconfig(self.component_kubeconfig(user), self.server, self.pki, user)
        try:
            self._start_etcd()
            self._start_apiserver(deadline=t0 + timeout_s)
            self._start_controllers()
            self._bootstrap(deadline=t0 + timeout_s)
        except BaseException:
            self.stop()
            raise
        self.progress(f"control plane up in {time.monotonic() - t0:.1f}s at {self.server}")

    def _spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        setpriv = shutil.which("setpriv") if self.die_with_caller else None
        if setpriv is not None:  # it sets the signal, then execs argv (same pid)
            # A caller that dies before the signal is set sends none: the shell, started after
            # it is set, goes if its parent is no longer this process, else execs argv.
            caller = str(os.getpid())
            argv = [setpriv, "--pdeathsig", "TERM", "--", "sh", "-c", _TIED, "sh", caller, *argv]
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            start_new_session=True,  # survives `kubetune dev up` exiting; not hit by Ctrl-C
        )
        log.close()
        self.processes[name] = proc
        self.state.pids[name] = proc.pid
        self.state.save()

    def _start_etcd(self) -> None:
        peer = self.state.etcd_peer_port or free_port()
        port = self.state.etcd_port
        self._spawn(
            "etcd",
            [
                str(self.binaries.etcd),
                "--name=kubetune",
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{port}",
                f"--advertise-client-urls=http://127.0.0.1:{port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=kubetune=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync=true",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self, deadline: float) -> None:
        self._spawn("kube-apiserver", self.apiserver_argv())
        self._wait_ready(deadline)

    def apiserver_argv(self) -> list[str]:
        p = self.pki
        return [
            str(self.binaries.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{self.state.etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.state.apiserver_port}",
            f"--tls-cert-file={p.serving_cert}",
            f"--tls-private-key-file={p.serving_key}",
            f"--client-ca-file={p.ca_cert}",
            f"--requestheader-client-ca-file={p.ca_cert}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--authorization-mode=Node,RBAC",
            # Nodes are reached at their InternalIP: a pod runner's Hostname resolves nowhere.
            "--kubelet-preferred-address-types=InternalIP",
            "--enable-admission-plugins=NodeRestriction",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={p.sa_pub}",
            f"--service-account-signing-key-file={p.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=1",
            *self.apiserver_args,
        ]

    def _https_get(self, path: str, timeout: float = 2.0) -> tuple[int, str]:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        cert, key = self.pki.client(ADMIN)
        ctx.load_cert_chain(str(cert), str(key))
        try:
            with urllib.request.urlopen(self.server + path, context=ctx, timeout=timeout) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode(errors="replace")

    def _wait_ready(self, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            for name in ("etcd", "kube-apiserver"):
                if not process_alive(self.state.pids[name]):
                    raise ClusterError(f"{name} exited:\n{self.log_tail(name)}")
            try:
                code, body = self._https_get("/readyz")
                if code == 200:
                    return
                last = body[-300:]
            except OSError as exc:
                last = str(exc)
            time.sleep(0.3)
        raise ClusterError(f"kube-apiserver not ready: {last}\n{self.log_tail('kube-apiserver')}")

    def _start_controllers(self) -> None:
        self._spawn("kube-controller-manager", self.controller_manager_argv())
        self._spawn("kube-scheduler", self.scheduler_argv())
        self._spawn("kwok", self.kwok_argv())
        self._spawn(
            "provisioner",
            [
                sys.executable,
                "-m",
                "kubetune_dev.provisioner",
                f"--kubeconfig={self.component_kubeconfig('provisioner')}",
                f"--volumes={self.volumes}",
                f"--storage-class={STORAGE_CLASS}",
            ],
        )

    def scheduler_argv(self) -> list[str]:
        kubeconfig = self.component_kubeconfig("scheduler")
        argv = [
            str(self.binaries.kube_scheduler),
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            "--v=1",
        ]
        if self.scheduler_config is None:
            return [*argv, f"--kubeconfig={kubeconfig}", "--leader-elect=false"]
        # With --config, kube-scheduler ignores --kubeconfig and --leader-elect.
        config = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            **self.scheduler_config,
        }
        config["clientConnection"] = {
            **(config.get("clientConnection") or {}),
            "kubeconfig": str(kubeconfig),
        }
        config["leaderElection"] = {"leaderElect": False}
        path = self.root / "kube-scheduler-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return [*argv, f"--config={path}"]

    def controller_manager_argv(self) -> list[str]:
        p = self.pki
        return [
            str(self.binaries.kube_controller_manager),
            f"--kubeconfig={self.component_kubeconfig('controller-manager')}",
            f"--authentication-kubeconfig={self.component_kubeconfig('controller-manager')}",
            f"--authorization-kubeconfig={self.component_kubeconfig('controller-manager')}",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            "--leader-elect=false",
            "--controllers=*,-node-ipam-controller",
            f"--service-account-private-key-file={p.sa_key}",
            f"--root-ca-file={p.ca_cert}",
            f"--cluster-signing-cert-file={p.ca_cert}",
            f"--cluster-signing-key-file={p.ca_key}",
            "--use-service-account-credentials=true",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--node-monitor-grace-period=40s",
            "--concurrent-job-syncs=10",
            "--v=1",
            *self.controller_manager_args,
        ]

    def kwok_argv(self) -> list[str]:
        argv = [
            str(self.binaries.kwok),
            f"--kubeconfig={self.component_kubeconfig('kwok')}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{free_port()}",
            "-v=WARN",
        ]
        if self.kwok_stages is not None:
            if not self.kwok_stages.is_file():
                raise ClusterError(
                    f"kwok stage file {self.kwok_stages} does not exist; to fix: pass the path "
                    "of a YAML file of kwok Stage objects, or none for the default stages"
                )
            argv.append(f"--config={self.kwok_stages}")
        elif self.binaries.kwok_stages.exists():
            argv.append(f"--config={self.binaries.kwok_stages}")
        return [*argv, *self.kwok_args]

    def _bootstrap(self, deadline: float) -> None:
        storage_class = {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": "kubetune.io/local",
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
        }
        sized = {
            **storage_class,
            "metadata": {"name": STORAGE_CLASS + SIZED_SUFFIX},  # not the default
        }
        self.apply([storage_class, sized])
        # Pods need the default ServiceAccount, which the controller-manager creates.
        while time.monotonic() < deadline:
            self.check_alive()
            out = self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False)
            if out.returncode == 0:
                return
            time.sleep(0.3)
        raise ClusterError(
            "the default ServiceAccount never appeared; see kube-controller-manager.log"
        )

    def start_etcd(self, timeout_s: float = 60.0) -> None:
        """Start etcd again on its ports and data (after `stop_component("etcd")`) and wait
        until the apiserver is ready again."""
        pid = self.state.pids.get("etcd")
        if pid is not None and process_alive(pid):
            raise ClusterError("etcd is running; stop it first with stop_component('etcd')")
        self._start_etcd()
        self._wait_ready(time.monotonic() + timeout_s)

    def stop(self, timeout_s: float = 15.0) -> list[str]:
        """Stop every component (SIGTERM, then SIGKILL); returns the names still alive. The
        sized volumes' file systems are unmounted (their memory freed); the folders stay."""
        alive = stop_processes(State.load(self.root) or self.state, timeout_s)
        unmount_volumes(self.volumes)
        return alive

    def status(self) -> dict[str, bool]:
        state = State.load(self.root)
        if state is None:
            return {}
        self.state = state
        return {name: process_alive(pid) for name, pid in state.pids.items()}

    @classmethod
    def attach(cls, root: Path, binaries: Binaries) -> LocalCluster:
        cluster = cls(root, binaries)
        state = State.load(root)
        if state is None:
            raise ClusterError(f"no cluster state under {root}; start one with `kubetune dev up`")
        cluster.state = state
        return cluster

    # ------------------------------------------------------------------ helpers

    def check_alive(self) -> None:
        """Raise with the log tail of the first component that exited."""
        for name, pid in self.state.pids.items():
            if not process_alive(pid):
                raise ClusterError(f"{name} exited:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return f"(no {path})"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binaries.kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def apply(self, docs: Iterable[Mapping[str, Any]], server_side: bool = True) -> None:
        text = "---\n".join(yaml.safe_dump(dict(d), sort_keys=False) for d in docs)
        args = ["apply", "-f", "-"]
        if server_side:
            args += ["--server-side", "--force-conflicts", "--field-manager=kubetune-dev"]
        self.kubectl(*args, input=text)

    def start_operator(
        self,
        settings: Mapping[str, str] | None = None,
        kubeconfig: Path | None = None,
        *,
        name: str = "operator",
        argv: Sequence[str] | None = None,
    ) -> int:
        """Run the operator against this cluster as its own process; its pid.

        By default `kopf run --standalone --all-namespaces`, as component `operator`.
        Several replicas run side by side under their own `name`s (e.g. `operator-a`) with
        their own `argv`, e.g. `kubetune operator` with leader election; `settings` are
        environment variables added to the cluster's; `kubeconfig` points it elsewhere than
        the admin kubeconfig (e.g. at a proxy).
        """
        env = self.env()
        env.update({"KUBETUNE_METRICS_PORT": "0", **(settings or {})})
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        if argv is None:
            argv = [sys.executable, "-m", "kopf", "run", "-m", "kubetune.controller.handlers"]
            argv = [*argv, "--standalone", "--all-namespaces"]
        self._spawn(name, argv, env=env)
        return self.state.pids[name]

    def stop_component(self, name: str, timeout_s: float = 15.0) -> bool:
        """Stop one component; True when it is gone."""
        pid = self.state.pids.pop(name, None)
        self.state.save()
        if pid is None:
            return True
        left = stop_processes(State(root=str(self.root), pids={name: pid}), timeout_s, save=False)
        return not left

    def start_pod_runner(
        self,
        node: str = "local-0",
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        gpus: int = 1,
        cpu: str = "64",
        memory: str = "512Gi",
        pod_ip_base: str | None = None,
    ) -> None:
        """Run the pods bound to `node` as local processes (docs/local-pod-runner.md).

        Several runners (one per node) can run side by side: each gets its own component
        name (`podrunner`, then `podrunner-<node>`) and needs its own `pod_ip_base`.
        """
        component = "podrunner" if "podrunner" not in self.state.pids else f"podrunner-{node}"
        argv = [
            sys.executable,
            "-m",
            "kubetune_dev.podrunner",
            f"--kubeconfig={self.component_kubeconfig('podrunner')}",
            f"--node={node}",
            f"--work={self.root / 'pods'}",
            f"--volumes-root={self.volumes}",
            f"--gpus={gpus}",
            f"--cpu={cpu}",
            f"--memory={memory}",
            # Container logs over TLS, so that `kubectl logs` reaches this node's pods.
            f"--tls-cert={self.pki.serving_cert}",
            f"--tls-key={self.pki.serving_key}",
        ]
        if pod_ip_base:
            argv.append(f"--pod-ip-base={pod_ip_base}")
        if labels:
            argv.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
        if taints:
            argv.append(
                "--taints="
                + ",".join(
                    t["key"] + (f"={t['value']}" if t.get("value") else "") + f":{t['effect']}"
                    for t in taints
                )
            )
        self._spawn(component, argv)

    def add_local_pool(
        self,
        pool: Mapping[str, Any],
        node: str = "local-0",
        pod_ip_base: str | None = None,
        *,
        nodes: Mapping[str, str | None] | None = None,
    ) -> None:
        """A GPUPool whose nodes are this machine: its pods run as local processes.

        One node (`node`, `pod_ip_base`), or several: `nodes` maps each node's name to its
        pod IP base (one pod runner each, so a multi-node plan's pods get distinct IPs and
        find each other through their headless Service)."""
        self.apply([pool])
        sim = simulated_nodes({**pool, "spec": {**pool["spec"], "maxNodes": 1}})[0]
        labels = {
            k: v
            for k, v in sim["metadata"]["labels"].items()
            if k not in ("kubernetes.io/hostname", "type")
        }
        for name, base in (nodes or {node: pod_ip_base}).items():
            self.start_pod_runner(
                name,
                labels=labels,
                taints=sim["spec"]["taints"],
                gpus=int(pool["spec"]["gpusPerNode"]),
                pod_ip_base=base,
            )

    def add_simulated_pools(self, pools: Sequence[Mapping[str, Any]]) -> None:
        """Create the GPUPools and, for each, `maxNodes` kwok nodes that match it."""
        self.apply(list(pools))
        self.apply([node for pool in pools for node in simulated_nodes(pool)])


def simulated_nodes(pool: Mapping[str, Any]) -> list[dict[str, Any]]:
    """kwok Node objects for a GPUPool: its labels, GPU capacity and GPU taints."""
    spec = pool["spec"]
    gpu = spec["gpu"]
    name = pool["metadata"]["name"]
    count = int(spec.get("gpusPerNode", 1))
    taints = []
    for tol in spec.get("tolerations", []):
        if tol.get("effect") in ("NoSchedule", "NoExecute") and tol.get("key"):
            taints.append(
                {"key": tol["key"], "value": tol.get("value") or "true", "effect": tol["effect"]}
            )
    nodes = []
    for i in range(int(spec.get("maxNodes", 1))):
        labels = {
            "kubernetes.io/hostname": f"{name}-{i}",
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": gpu["product"],
            "nvidia.com/gpu.memory": str(int(float(gpu["memoryGiB"]) * 1024)),
            "nvidia.com/gpu.count": str(count),
            **spec.get("nodeSelector", {}),
        }
        capacity = {
            "cpu": str(16 * count),
            "memory": f"{128 * count}Gi",
            "pods": "110",
            "nvidia.com/gpu": str(count),
            "ephemeral-storage": "1Ti",
        }
        nodes.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": f"{name}-{i}",
                    "labels": labels,
                    "annotations": {KWOK_NODE_ANNOTATION: "fake"},
                },
                "spec": {"taints": taints},
                "status": {"capacity": capacity, "allocatable": capacity},
            }
        )
    return nodes
