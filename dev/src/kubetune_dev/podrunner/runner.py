"""The runner loop: the pods bound to one node, reconciled with local processes.

`PodRunner` registers the Node, keeps its Lease and heartbeat, lists the node's pods every poll,
and moves each through admit → prepare → init containers → containers → report → final delete,
single-threaded. See the package docstring for what it does as a kubelet.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

from kubetune_dev.podrunner.api import Api, ApiError, ApiLookup, ns_path
from kubetune_dev.podrunner.logserver import PRIVATE_DIR, exited_marker
from kubetune_dev.podrunner.node import lease_manifest, micro_time, node_manifest, node_status
from kubetune_dev.podrunner.podspec import (
    CLUSTER_DOMAIN,
    DEFAULT_HOST_IP,
    NotReady,
    PodFacts,
    build_env,
    container_argv,
    hosts_file,
    pod_hostname,
)
from kubetune_dev.podrunner.sandbox import (
    START_ERROR_EXIT,
    ExecSpec,
    mount_points_dir,
    remove_unused_mount_points,
)
from kubetune_dev.podrunner.status import (
    TERMINAL_PHASES,
    ContainerRun,
    exit_status,
    parse_oom_kills,
    pod_status,
    rfc3339,
    termination_grace,
    termination_message,
)
from kubetune_dev.podrunner.volumes import (
    Mount,
    image_env,
    materialise,
    plan_mounts,
    plan_volumes,
    runtime_paths,
)

log = logging.getLogger("kubetune.podrunner")

DEFAULT_POD_IP_BASE = "127.0.100."
LEASE_SECONDS = 40
HEARTBEAT_SECONDS = 10.0
POLL_SECONDS = 0.5
RETRY_SECONDS = 1.0
CONTAINER_ID_PREFIX = "podrunner://"
METRICS_ADDR_ENV = "KUBETUNE_METRICS_ADDR"
"""Where kubetune's trainer serves its metrics (kubetune_trainer.metrics.ADDR_ENV)."""


def _oom_kills() -> int | None:
    try:
        return parse_oom_kills(Path("/proc/vmstat").read_text())
    except OSError:
        return None


@dataclass
class ContainerProc:
    run: ContainerRun
    spec: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    oom_before: int | None = None
    killed: bool = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


@dataclass
class PodRecord:
    uid: str
    namespace: str
    name: str
    pod: dict[str, Any]
    dir: Path
    ip: str
    start_time: str
    init: list[ContainerProc]
    main: list[ContainerProc]
    stage: str = "preparing"  # preparing | init | running | done
    next_attempt: float = 0.0
    deadline: float | None = None
    grace: int = 0
    kill_sent: bool = False
    reported: dict[str, Any] | None = None
    deleted: bool = False
    hosts: str = ""
    last_event: str = ""

    @property
    def containers(self) -> list[ContainerProc]:
        return self.init + self.main

    @property
    def private(self) -> Path:
        return self.dir / PRIVATE_DIR

    @property
    def hosts_path(self) -> Path:
        return self.private / "hosts"


@dataclass
class RunnerConfig:
    node: str
    work: Path
    volumes_root: Path
    capacity: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)
    pod_ip_base: str = DEFAULT_POD_IP_BASE
    host_ip: str = DEFAULT_HOST_IP
    mount_namespace: bool = True
    pass_env: tuple[str, ...] = ("LANG", "LC_ALL", "TZ")
    poll_seconds: float = POLL_SECONDS
    heartbeat_seconds: float = HEARTBEAT_SECONDS
    lease_seconds: int = LEASE_SECONDS
    cluster_domain: str = CLUSTER_DOMAIN
    kubelet_port: int = 0  # where container logs are served (logserver.py); 0: nowhere


class PodRunner:
    """Reconciles the pods bound to one node with local processes (single-threaded)."""

    def __init__(self, api: Api, config: RunnerConfig) -> None:
        self.api = api
        self.config = config
        self.lookup = ApiLookup(api, config.volumes_root)
        self.records: dict[str, PodRecord] = {}
        self.finalized: set[str] = set()
        self.node_uid: str | None = None
        self.node_since = rfc3339()
        self.next_heartbeat = 0.0
        self.listed_ips: set[str] = set()
        self.peers: dict[tuple[str, str], dict[str, str]] = {}
        self.stale_resources: list[str] = []

    # ------------------------------------------------------------------ node

    def register_node(self) -> None:
        cfg = self.config
        manifest = node_manifest(cfg.node, cfg.labels, cfg.taints)
        try:
            node = self.api.call("POST", "/api/v1/nodes", manifest)
        except ApiError as exc:
            if exc.code != 409:
                raise
            patch = {
                "metadata": {"labels": manifest["metadata"]["labels"]},
                "spec": manifest["spec"],
            }
            node = self.api.patch(f"/api/v1/nodes/{quote(cfg.node)}", patch, "merge")
        self.node_uid = str(node["metadata"]["uid"])
        self.node_since = rfc3339()
        # A strategic-merge patch merges maps: resources of an earlier run must be nulled.
        old = (node.get("status") or {}).get("capacity") or {}
        self.stale_resources = sorted(set(old) - set(cfg.capacity))
        self.heartbeat(force=True)
        log.info("node %s registered (capacity %s)", cfg.node, cfg.capacity)

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self.next_heartbeat:
            return
        cfg = self.config
        status = node_status(
            cfg.capacity,
            host_ip=cfg.host_ip,
            name=cfg.node,
            now=rfc3339(),
            since=self.node_since,
            kubelet_port=cfg.kubelet_port,
        )
        for key in self.stale_resources:
            status["capacity"][key] = status["allocatable"][key] = None
        try:
            self.api.patch(f"/api/v1/nodes/{quote(cfg.node)}/status", {"status": status})
            self.stale_resources = []
        except ApiError as exc:
            if exc.code == 404:  # someone deleted the node: register again
                self.register_node()
                return
            raise
        lease_path = ns_path("kube-node-lease", "leases", cfg.node, "coordination.k8s.io/v1")
        lease = lease_manifest(cfg.node, self.node_uid, micro_time(), cfg.lease_seconds)
        try:
            self.api.patch(lease_path, {"spec": lease["spec"]}, "merge")
        except ApiError as exc:
            if exc.code != 404:
                raise
            self.api.call(
                "POST",
                ns_path("kube-node-lease", "leases", "", "coordination.k8s.io/v1"),
                lease,
            )
        self.next_heartbeat = now + cfg.heartbeat_seconds  # a failed one is retried next tick

    # ------------------------------------------------------------------ main loop

    def run(self, stopping: Callable[[], bool]) -> None:
        failures = 0
        while self.node_uid is None and not stopping():
            try:
                self.register_node()
            except Exception as exc:  # the apiserver may still be starting
                failures += 1
                if failures <= 3 or failures % 20 == 0:
                    log.warning("registering node %s failed: %s", self.config.node, exc)
                time.sleep(self.config.poll_seconds)
        failures = 0
        try:
            while not stopping():
                try:
                    self.heartbeat()
                    self.sync_once()
                    failures = 0
                except Exception as exc:  # keep serving; the apiserver may be restarting
                    failures += 1
                    if failures <= 3 or failures % 20 == 0:
                        log.warning("sync failed (%d in a row): %s", failures, exc)
                time.sleep(self.config.poll_seconds)
        finally:
            self.shutdown()

    def list_pods(self) -> list[dict[str, Any]]:
        out = self.api.call(
            "GET", "/api/v1/pods", params={"fieldSelector": f"spec.nodeName={self.config.node}"}
        )
        return list(out.get("items") or [])

    def sync_once(self) -> None:
        pods = self.list_pods()
        uids = {str(p["metadata"]["uid"]) for p in pods}
        self.listed_ips = {
            str((p.get("status") or {}).get("podIP"))
            for p in pods
            if (p.get("status") or {}).get("podIP")
        }
        for uid in [u for u in self.records if u not in uids]:
            self._forget(self.records.pop(uid))
        self.finalized &= uids
        for pod in pods:
            try:
                self._sync_pod(pod)
            except ApiError as exc:
                meta = pod["metadata"]
                log.warning("pod %s/%s: %s", meta.get("namespace"), meta.get("name"), exc)
        self._refresh_peers()
        self._refresh_hosts()
        self._cleanup_mount_points()

    # ------------------------------------------------------------------ one pod

    def _sync_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = str(meta["uid"])
        deleting = bool(meta.get("deletionTimestamp"))
        rec = self.records.get(uid)
        if rec is None:
            phase = (pod.get("status") or {}).get("phase")
            if phase in TERMINAL_PHASES:
                if deleting:
                    self._final_delete(pod)
                return
            if phase == "Running":
                # Started by an earlier runner whose processes are gone: report it lost.
                self._report_lost(pod)
                return
            if deleting:
                self._final_delete(pod)
                return
            rec = self._admit(pod)
        rec.pod = pod
        if deleting:
            if rec.stage == "preparing":  # nothing started: nothing to stop
                rec.stage = "done"
                rec.deleted = self._final_delete(pod)
                return
            grace = termination_grace(pod)
            if rec.deadline is None:
                self._begin_termination(rec, grace)
            elif grace < rec.grace:  # deleted again with a shorter grace period
                rec.deadline = min(rec.deadline, time.monotonic() + grace)
                rec.grace = grace
        self._advance(rec)
        self._report(rec)
        finished = rec.stage == "done" and not any(c.alive for c in rec.containers)
        if finished and deleting and not rec.deleted and rec.reported is not None:
            rec.deleted = self._final_delete(pod)

    def _admit(self, pod: dict[str, Any]) -> PodRecord:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        namespace, name, uid = str(meta["namespace"]), str(meta["name"]), str(meta["uid"])
        pod_dir = self.config.work / f"{namespace}_{name}"
        marker = pod_dir / PRIVATE_DIR / "uid"
        if pod_dir.exists() and (not marker.exists() or marker.read_text() != uid):
            shutil.rmtree(pod_dir, ignore_errors=True)
        (pod_dir / PRIVATE_DIR).mkdir(parents=True, exist_ok=True)
        marker.write_text(uid)

        def runs(key: str) -> list[ContainerProc]:
            return [
                ContainerProc(
                    ContainerRun(str(c["name"]), image=str(c.get("image") or "")), dict(c)
                )
                for c in spec.get(key) or []
            ]

        rec = PodRecord(
            uid=uid,
            namespace=namespace,
            name=name,
            pod=pod,
            dir=pod_dir,
            ip=self._allocate_ip(),
            start_time=rfc3339(),
            init=runs("initContainers"),
            main=runs("containers"),
        )
        if (spec.get("restartPolicy") or "Always") != "Never":
            log.info(
                "pod %s/%s: restartPolicy %s is treated as Never",
                namespace,
                name,
                spec.get("restartPolicy") or "Always",
            )
        self.records[uid] = rec
        log.info("pod %s/%s admitted with IP %s", namespace, name, rec.ip)
        return rec

    def _allocate_ip(self) -> str:
        used = {r.ip for r in self.records.values()} | self.listed_ips
        for i in range(2, 255):
            ip = f"{self.config.pod_ip_base}{i}"
            if ip not in used:
                return ip
        raise RuntimeError(f"no free pod IP left in {self.config.pod_ip_base}0/24")

    def _prepare(self, rec: PodRecord) -> None:
        """Volumes, env, mounts and exec specs of every container (raises NotReady)."""
        cfg = self.config
        facts = PodFacts(rec.ip, cfg.host_ip, cfg.node, cfg.capacity)
        volumes = plan_volumes(rec.pod, rec.dir, self.lookup, facts)
        for cp in rec.containers:
            cp.env = build_env(rec.pod, cp.spec, self.lookup, facts)
        for volume in volumes.values():
            materialise(volume)
        rec.hosts = hosts_file(rec.pod, rec.ip, self._siblings(rec), cfg.cluster_domain)
        rec.hosts_path.write_text(rec.hosts)
        for cp in rec.containers:
            term = rec.private / f"{cp.run.name}.termination-log"
            term.write_bytes(b"")
            term.chmod(0o666)
            cp.mounts = plan_mounts(
                cp.spec,
                volumes,
                cp.env,
                hosts_file=str(rec.hosts_path),
                termination_file=str(term),
                keep_visible=runtime_paths(),
            )
            for m in cp.mounts:
                if not os.path.lexists(m.source):  # a subPath the volume does not have yet
                    os.makedirs(m.source, exist_ok=True)

    def _base_env(self, rec: PodRecord) -> dict[str, str]:
        """What the image would have provided: PATH (this Python's bin first), locale, the
        API server's address, HOSTNAME; and, standing in for the pod's own network namespace,
        the trainer's metrics address: its pod IP, so that two trainer pods on this machine
        do not share 0.0.0.0:9400 (one still running while its replacement starts); and what
        the trainer image sets that this machine lacks (`image_env`)."""
        env = {k: os.environ[k] for k in self.config.pass_env if k in os.environ}
        default_path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        env["PATH"] = (
            f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', default_path)}"
        )
        env["HOSTNAME"] = pod_hostname(rec.pod)
        server = urlparse(self.api.server)
        if server.hostname:
            env["KUBERNETES_SERVICE_HOST"] = server.hostname
            env["KUBERNETES_SERVICE_PORT"] = str(server.port or 443)
        env[METRICS_ADDR_ENV] = rec.ip
        env.update(image_env())
        return env

    def _start(self, rec: PodRecord, cp: ContainerProc) -> None:
        run = cp.run
        now = rfc3339()
        try:
            argv = container_argv(cp.spec, {**self._base_env(rec), **cp.env})
        except NotReady as exc:
            run.state, run.reason, run.message = "terminated", exc.reason, exc.message
            run.exit_code, run.started_at, run.finished_at = START_ERROR_EXIT, now, now
            self._event(rec, "Failed", exc.message, "Warning", cp)
            return
        private = rec.private
        spec = ExecSpec(
            argv=argv,
            env={**self._base_env(rec), **cp.env},
            cwd=cp.spec.get("workingDir") or None,
            hostname=pod_hostname(rec.pod),
            mounts=cp.mounts,
            namespace=self.config.mount_namespace,
            created_file=str(mount_points_dir() / "created" / f"{uuid.uuid4().hex}.json"),
            error_file=str(private / f"{run.name}.start-error"),
            parent_pid=os.getpid(),
            mount_points=str(mount_points_dir()),
        )
        spec_path = private / f"{run.name}.exec.json"
        spec_path.write_text(spec.to_json())
        with (rec.dir / f"{run.name}.log").open("wb") as out:
            cp.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kubetune_dev.podrunner",
                    "--exec-container",
                    str(spec_path),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(rec.dir),
                start_new_session=True,
            )
        cp.oom_before = _oom_kills()
        run.state, run.reason, run.message = "running", "", ""
        run.started_at = now
        run.container_id = f"{CONTAINER_ID_PREFIX}{rec.uid}/{run.name}/{cp.proc.pid}"
        log.info(
            "pod %s/%s: started %s (pid %d): %s",
            rec.namespace,
            rec.name,
            run.name,
            cp.proc.pid,
            " ".join(argv),
        )
        self._event(rec, "Started", f"Started container {run.name}", "Normal", cp)

    def _collect(self, rec: PodRecord, cp: ContainerProc) -> bool:
        """Record the exit of a finished process; True if it had finished."""
        if cp.proc is None or cp.run.state != "running":
            return False
        code = cp.proc.poll()
        if code is None:
            return False
        # The container stopped: what is left of it goes too (without a PID namespace,
        # whatever stayed in its process group).
        _kill_group(cp, signal.SIGKILL)
        run = cp.run
        run.finished_at = rfc3339()
        error_file = rec.private / f"{run.name}.start-error"
        error = error_file.read_text(errors="replace") if error_file.exists() else ""
        if error:
            run.state, run.exit_code, run.reason, run.message = (
                "terminated",
                START_ERROR_EXIT,
                "StartError",
                error,
            )
            self._event(rec, "Failed", f"Error: {error}", "Warning", cp)
        else:
            oom_after = _oom_kills()
            oom = (
                not cp.killed
                and cp.oom_before is not None
                and oom_after is not None
                and oom_after > cp.oom_before
            )
            run.exit_code, run.reason, run.signal = exit_status(code, oom=oom)
            run.state = "terminated"
            term = rec.private / f"{run.name}.termination-log"
            written = term.read_bytes() if term.exists() else b""
            log_path = rec.dir / f"{run.name}.log"
            tail = b""
            if log_path.exists():
                with log_path.open("rb") as f:
                    f.seek(max(0, log_path.stat().st_size - 16384))
                    tail = f.read()
            run.message = termination_message(
                written,
                tail,
                policy=str(cp.spec.get("terminationMessagePolicy") or "File"),
                exit_code=run.exit_code,
            )
        # Tells a follower of the container's log (logserver.py) that no more output comes.
        with contextlib.suppress(OSError):
            exited_marker(rec.dir, run.name).write_text(str(run.exit_code))
        log.info(
            "pod %s/%s: %s exited %s (%s)",
            rec.namespace,
            rec.name,
            run.name,
            run.exit_code,
            run.reason,
        )
        return True

    def _advance(self, rec: PodRecord) -> None:
        now = time.monotonic()
        terminating = rec.deadline is not None
        if rec.stage == "preparing":
            if now < rec.next_attempt:
                return
            try:
                self._prepare(rec)
                rec.stage = "init"
            except NotReady as exc:
                rec.next_attempt = now + RETRY_SECONDS
                for cp in rec.containers:
                    cp.run.reason = (
                        exc.reason
                        if exc.reason == "CreateContainerConfigError"
                        else "ContainerCreating"
                    )
                    cp.run.message = exc.message
                if exc.message != rec.last_event:
                    rec.last_event = exc.message
                    self._event(rec, exc.reason, exc.message, "Warning")
                return
            except OSError as exc:
                rec.next_attempt = now + RETRY_SECONDS
                for cp in rec.containers:
                    cp.run.message = f"preparing volumes: {exc}"
                return
        if rec.stage == "init":
            for cp in rec.init:
                self._collect(rec, cp)
                if cp.run.state == "terminated":
                    if not cp.run.succeeded:
                        for main in rec.main:
                            main.run.reason, main.run.message = "PodInitializing", ""
                        rec.stage = "done"
                        return
                    continue
                if cp.proc is None:
                    if terminating:
                        rec.stage = "done"
                        return
                    self._start(rec, cp)
                    if cp.run.state == "terminated":  # could not start
                        rec.stage = "done"
                return
            rec.stage = "running"
            if terminating:
                rec.stage = "done"
                return
            for cp in rec.main:
                self._start(rec, cp)
        if rec.stage == "running":
            for cp in rec.main:
                self._collect(rec, cp)
            if all(cp.run.state == "terminated" for cp in rec.main):
                rec.stage = "done"
        if rec.deadline is not None and not rec.kill_sent and now >= rec.deadline:
            live = [cp for cp in rec.containers if cp.alive]
            for cp in live:
                cp.killed = True
                _kill_group(cp, signal.SIGKILL)
            rec.kill_sent = True

    def _begin_termination(self, rec: PodRecord, grace: int) -> None:
        rec.deadline = time.monotonic() + grace
        rec.grace = grace
        for cp in rec.containers:
            if cp.alive and cp.proc is not None:
                log.info(
                    "pod %s/%s: SIGTERM %s (grace %ds)", rec.namespace, rec.name, cp.run.name, grace
                )
                self._event(rec, "Killing", f"Stopping container {cp.run.name}", "Normal", cp)
                # Like a container runtime: SIGTERM to the container's main process only
                # (the helper relays it to PID 1 of the container's PID namespace).
                with contextlib.suppress(ProcessLookupError):
                    os.kill(cp.proc.pid, signal.SIGTERM)

    def _report(self, rec: PodRecord, timeout: float | None = None) -> None:
        if rec.deleted:
            return
        status = pod_status(
            rec.pod,
            [c.run for c in rec.init],
            [c.run for c in rec.main],
            pod_ip=rec.ip,
            host_ip=self.config.host_ip,
            start_time=rec.start_time,
            now=rfc3339(),
        )
        if status == rec.reported:
            return
        self._patch_status(rec.pod, status, timeout)
        rec.reported = status

    def _patch_status(
        self, pod: Mapping[str, Any], status: dict[str, Any], timeout: float | None = None
    ) -> None:
        meta = pod["metadata"]
        path = ns_path(str(meta["namespace"]), "pods", str(meta["name"])) + "/status"
        body = {"metadata": {"uid": meta["uid"]}, "status": status}
        self.api.patch(path, body, timeout=timeout)

    def _report_lost(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        now = rfc3339()

        def lost(c: Mapping[str, Any]) -> ContainerRun:
            return ContainerRun(
                str(c["name"]),
                image=str(c.get("image") or ""),
                state="terminated",
                reason="ContainerStatusUnknown",
                message="The container could not be located when the pod was terminated "
                "(the local pod runner restarted)",
                exit_code=137,
                started_at=now,
                finished_at=now,
            )

        init = [lost(c) for c in spec.get("initContainers") or []]
        for run, old in zip(
            init, (pod.get("status") or {}).get("initContainerStatuses") or [], strict=False
        ):
            if (
                "terminated" in (old.get("state") or {})
                and old["state"]["terminated"].get("exitCode") == 0
            ):
                run.reason, run.exit_code, run.message = "Completed", 0, ""
        main = [lost(c) for c in spec.get("containers") or []]
        status = pod.get("status") or {}
        ip = str(status.get("podIP") or self.config.host_ip)
        new = pod_status(
            pod,
            init,
            main,
            pod_ip=ip,
            host_ip=self.config.host_ip,
            start_time=str(status.get("startTime") or now),
            now=now,
        )
        log.info(
            "pod %s/%s: lost by an earlier runner, reported Failed", meta["namespace"], meta["name"]
        )
        self._patch_status(pod, new)

    def _final_delete(self, pod: Mapping[str, Any]) -> bool:
        meta = pod["metadata"]
        uid = str(meta["uid"])
        if uid in self.finalized:
            return True
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": uid},
        }
        try:
            self.api.call(
                "DELETE", ns_path(str(meta["namespace"]), "pods", str(meta["name"])), body
            )
        except ApiError as exc:
            if exc.code not in (404, 409):
                log.warning("final delete of %s/%s: %s", meta["namespace"], meta["name"], exc)
                return False
        self.finalized.add(uid)
        log.info("pod %s/%s: deleted (grace 0)", meta["namespace"], meta["name"])
        return True

    def _forget(self, rec: PodRecord) -> None:
        """The pod object is gone: kill what is left, free its IP and its volumes."""
        live = [cp for cp in rec.containers if cp.alive]
        for cp in live:
            cp.killed = True
            _kill_group(cp, signal.SIGKILL)
        _reap([cp for cp in rec.containers if cp.proc is not None], timeout=5.0)
        for cp in rec.containers:
            if cp.run.state == "running":
                self._collect(rec, cp)
        if live:
            log.info("pod %s/%s vanished: killed its processes", rec.namespace, rec.name)
        shutil.rmtree(rec.dir / "volumes", ignore_errors=True)

    def _refresh_peers(self) -> None:
        """Hostname → IP of the pods behind each headless Service that this runner's pods
        name as their subdomain, as cluster DNS would answer `<hostname>.<service>`: pods the
        Service selects, with that hostname and subdomain, not finished, with an IP. Pods
        that other nodes (other runners) run resolve too, so the pods of one Indexed Job on
        two nodes find each other (a rendezvous endpoint `<job>-0.<service>`). Read from the
        pods themselves, not the endpoint controllers: those refuse loopback pod IPs. A
        failed read keeps the last answer."""
        wanted = {
            (rec.namespace, str(subdomain))
            for rec in self.records.values()
            if rec.stage != "done" and (subdomain := (rec.pod.get("spec") or {}).get("subdomain"))
        }
        peers: dict[tuple[str, str], dict[str, str]] = {}
        for namespace, service in sorted(wanted):
            try:
                peers[(namespace, service)] = self._service_hosts(namespace, service)
            except ApiError as exc:
                log.debug("peers behind %s/%s: %s", namespace, service, exc)
                peers[(namespace, service)] = self.peers.get((namespace, service), {})
        self.peers = peers

    def _service_hosts(self, namespace: str, service: str) -> dict[str, str]:
        try:
            svc = self.api.call("GET", ns_path(namespace, "services", service))
        except ApiError as exc:
            if exc.code == 404:
                return {}
            raise
        spec = svc.get("spec") or {}
        selector = spec.get("selector") or {}
        if spec.get("clusterIP") != "None" or not selector:
            return {}
        out = self.api.call(
            "GET",
            ns_path(namespace, "pods"),
            params={"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))},
        )
        found: dict[str, str] = {}
        for pod in out.get("items") or []:
            pod_spec = pod.get("spec") or {}
            status = pod.get("status") or {}
            if (
                pod_spec.get("hostname")
                and pod_spec.get("subdomain") == service
                and status.get("podIP")
                and status.get("phase") not in TERMINAL_PHASES
            ):
                found[str(pod_spec["hostname"])] = str(status["podIP"])
        return found

    def _siblings(self, rec: PodRecord) -> dict[str, str]:
        subdomain = (rec.pod.get("spec") or {}).get("subdomain")
        if not subdomain:
            return {}
        # Other nodes' pods from the Service's endpoints; this runner's own pods are known
        # first-hand (and before the endpoint controller has seen their IPs).
        out: dict[str, str] = dict(self.peers.get((rec.namespace, str(subdomain)), {}))
        for other in self.records.values():
            spec = other.pod.get("spec") or {}
            if other.namespace == rec.namespace and spec.get("subdomain") == subdomain:
                out[pod_hostname(other.pod)] = other.ip
        return out

    def _refresh_hosts(self) -> None:
        """Rewrite each running pod's /etc/hosts in place (same inode: the bind mount sees it)
        when a sibling came or went."""
        for rec in self.records.values():
            if rec.stage not in ("init", "running"):
                continue
            text = hosts_file(rec.pod, rec.ip, self._siblings(rec), self.config.cluster_domain)
            if text != rec.hosts:
                with contextlib.suppress(OSError), rec.hosts_path.open("r+") as f:
                    f.write(text)
                    f.truncate()
                rec.hosts = text

    def _cleanup_mount_points(self) -> None:
        """Remove the empty mount points created on the host once no container of this
        machine runs (sandbox.remove_unused_mount_points)."""
        if any(cp.alive for rec in self.records.values() for cp in rec.containers):
            return
        with contextlib.suppress(OSError):
            remove_unused_mount_points(mount_points_dir())

    def _event(
        self,
        rec: PodRecord,
        reason: str,
        message: str,
        kind: str = "Normal",
        cp: ContainerProc | None = None,
    ) -> None:
        now = rfc3339()
        involved: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": rec.namespace,
            "name": rec.name,
            "uid": rec.uid,
        }
        if cp is not None:
            involved["fieldPath"] = f"spec.containers{{{cp.run.name}}}"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{rec.name}.", "namespace": rec.namespace},
            "involvedObject": involved,
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": "kubelet", "host": self.config.node},
            "reportingComponent": "kubelet",
            "reportingInstance": self.config.node,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        with contextlib.suppress(Exception):
            self.api.call("POST", ns_path(rec.namespace, "events"), event)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Kill every container, report the pods terminated (best effort, a few seconds at
        most: the API server may be stopping too), tidy up."""
        procs = [cp for rec in self.records.values() for cp in rec.containers if cp.alive]
        for cp in procs:
            cp.killed = True
            _kill_group(cp, signal.SIGKILL)
        _reap(procs, timeout=5.0)
        budget = time.monotonic() + 5.0
        for rec in self.records.values():
            changed = False
            for cp in rec.containers:
                if cp.run.state == "running" and self._collect(rec, cp):
                    cp.run.message = cp.run.message or "the local pod runner stopped"
                    changed = True
            if changed and not rec.deleted and time.monotonic() < budget:
                with contextlib.suppress(Exception):
                    self._report(rec, timeout=2.0)
        self._cleanup_mount_points()
        log.info("stopped; killed %d process(es)", len(procs))


def _kill_group(cp: ContainerProc, sig: int) -> None:
    if cp.proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(cp.proc.pid, sig)


def _reap(procs: Sequence[ContainerProc], timeout: float) -> None:
    end = time.monotonic() + timeout
    for cp in procs:
        if cp.proc is None:
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            cp.proc.wait(timeout=max(0.0, end - time.monotonic()))
