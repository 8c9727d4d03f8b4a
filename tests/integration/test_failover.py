"""Failover drill: two `kubetune operator` replicas with leader election on the local cluster.

Each test runs its own replicas (`LocalCluster.start_operator` with `kubetune operator` as the
command), watching only the test's namespace and sharing a Lease there, with short timings:
lease duration 10 s, renew deadline 8 s, retry 1 s. (A renew deadline of 4 s was once missed in
CI by a new leader taking over 50 jobs while another test worker kept both cores busy: its
renewals, made on its event loop, came 2.5 s apart and then not for 4 s. The production
defaults are 15, 10 and 2 s.) The session's operator (a standalone one
that watches every namespace, started by other modules' tests) is paused meanwhile, so that
the replicas are the only operators acting on the drill's jobs.

- killed: the leader gets SIGKILL while ~50 FineTuneJobs are being planned, queued and run;
  the standby takes the Lease over and writes statuses again; every job ends Succeeded with
  one batch Job each (a second launch for one job would show up as a second Job).
- stopped: a leader stopped with SIGTERM releases the Lease; the standby takes over at once.
- partitioned: the leader reaches the API server through a TCP forwarder that the test
  severs; it logs "lost the lease" and exits with status 3 within its renew deadline, and the
  other replica takes over.

The measured times are printed (`pytest -s` shows them); docs/operations.md quotes them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetune.controller.leader import EXIT_LEASE_LOST
from kubetune_dev.cluster import LocalCluster, free_port
from support.cluster import FAST_OPERATOR, Cluster, job_doc, operators_paused
from support.tcpproxy import TcpProxy
from support.waiting import wait_for

pytestmark = pytest.mark.integration

LEASE = "kubetune-drill"
DURATION_S, RENEW_DEADLINE_S, RETRY_S = 10, 8, 1
TAKEOVER_LIMIT_S = 30


class Replicas:
    """`kubetune operator` processes electing a leader in one namespace."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster = cluster
        self.local: LocalCluster = cluster.local
        self.namespace = namespace
        self.names: list[str] = []
        self.offsets: dict[str, int] = {}  # where each replica's log starts (logs append)

    def start(self, name: str, kubeconfig: Path | None = None) -> int:
        settings = {
            "POD_NAME": name,
            "KUBETUNE_LEADER_ELECTION": "true",
            "KUBETUNE_LEASE_NAME": LEASE,
            "KUBETUNE_LEASE_NAMESPACE": self.namespace,
            "KUBETUNE_LEASE_DURATION_SECONDS": str(DURATION_S),
            "KUBETUNE_LEASE_RENEW_DEADLINE_SECONDS": str(RENEW_DEADLINE_S),
            "KUBETUNE_LEASE_RETRY_SECONDS": str(RETRY_S),
            "KUBETUNE_POLL_SECONDS": "1",
            "KUBETUNE_QUEUE_RETRY_SECONDS": "2",
            "KUBETUNE_TRAINER_IMAGE": "kubetune/trainer:drill",
            # Hub models planned and launched directly, as in the rest of the tier.
            "KUBETUNE_STAGE_IN_HUB": FAST_OPERATOR["KUBETUNE_STAGE_IN_HUB"],
        }
        if kubeconfig is not None:
            settings["KUBECONFIG"] = str(kubeconfig)
        argv = [sys.executable, "-m", "kubetune.cli", "operator", "-n", self.namespace]
        argv.append(f"--liveness=http://127.0.0.1:{free_port()}/healthz")
        self.names.append(name)
        log = self.local.logs / f"{name}.log"
        self.offsets[name] = log.stat().st_size if log.exists() else 0
        return self.local.start_operator(settings, name=name, argv=argv)

    def log(self, name: str) -> str:
        data = (self.local.logs / f"{name}.log").read_bytes()
        return data[self.offsets[name] :].decode(errors="replace")

    def exit_status(self, name: str) -> int | None:
        return self.local.processes[name].poll()

    def leader(self) -> str:
        """The replica named in the Lease's holderIdentity ("" when none holds it)."""
        lease = self.cluster.get("lease", LEASE, self.namespace)
        holder = ((lease or {}).get("spec") or {}).get("holderIdentity") or ""
        return str(holder.rsplit("_", 1)[0])

    def wait_leader(self, name: str, timeout: float = 60) -> float:
        """Wait until `name` holds the Lease; when it acquired it (wall clock, its own)."""

        def holds() -> bool:
            status = self.exit_status(name)
            assert status is None, f"{name} exited {status}:\n{self.log(name)[-3000:]}"
            return self.leader() == name

        wait_for(f"{name} to hold the lease", holds, timeout=timeout, interval=0.1)
        lease = self.cluster.get("lease", LEASE, self.namespace)
        assert lease is not None
        return datetime.fromisoformat(lease["spec"]["acquireTime"]).timestamp()

    def wait_standing_by(self, name: str, timeout: float = 60) -> None:
        wait_for(
            f"{name} to stand by",
            lambda: "standing by" in self.log(name) and self.exit_status(name) is None,
            timeout=timeout,
            interval=0.1,
        )

    def stop_all(self) -> None:
        for name in self.names:
            self.local.stop_component(name, timeout_s=20)


@pytest.fixture
def replicas(cluster: Cluster, namespace: str) -> Iterator[Replicas]:
    group = Replicas(cluster, namespace)
    with operators_paused(cluster.local):
        try:
            yield group
        finally:
            # Delete the jobs while a replica runs: no loop outlives its job.
            cluster.kubectl(
                "delete",
                "ftj",
                "--all",
                "-n",
                namespace,
                "--wait=true",
                "--timeout=45s",
                check=False,
            )
            group.stop_all()


class JobLog:
    """Every batch Job ever created in a namespace, from a watch (deleted ones included)."""

    def __init__(self, local: LocalCluster, namespace: str, path: Path) -> None:
        self.path = path
        with path.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    str(local.binaries.kubectl),
                    f"--kubeconfig={local.kubeconfig}",
                    "get",
                    "jobs.batch",
                    "-n",
                    namespace,
                    "--watch",
                    "--output-watch-events",
                    "-o",
                    "json",
                ],
                stdout=out,
                stderr=subprocess.DEVNULL,
            )

    def jobs_by_owner(self) -> dict[str, set[tuple[str, str]]]:
        """FineTuneJob name -> {(batch Job name, uid)} seen."""
        self.proc.terminate()
        self.proc.wait(timeout=10)
        seen: dict[str, set[tuple[str, str]]] = defaultdict(set)
        decoder = json.JSONDecoder()
        text, i = self.path.read_text(), 0
        while True:
            while i < len(text) and text[i].isspace():
                i += 1
            if i >= len(text):
                break
            event, i = decoder.raw_decode(text, i)
            meta = event["object"]["metadata"]
            owner = meta.get("labels", {}).get("kubetune.io/job", "")
            seen[owner].add((meta["name"], meta["uid"]))
        return seen


def statuses(cluster: Cluster, namespace: str) -> dict[str, dict[str, Any]]:
    return {
        obj["metadata"]["name"]: obj.get("status") or {}
        for obj in cluster.list("finetunejobs", namespace)
    }


def jobs(prefix: str, count: int) -> list[dict[str, Any]]:
    """Small LoRA jobs; every fifth wants all 8 GPUs of an H100 node (2 nodes), so they queue."""
    out = []
    for i in range(count):
        if i % 5 == 4:
            out.append(job_doc(f"{prefix}-{i:02d}", resources={"pools": ["h100"], "gpus": 8}))
        else:
            out.append(job_doc(f"{prefix}-{i:02d}"))
    return out


def wait_all_succeeded(cluster: Cluster, namespace: str, count: int, timeout: float) -> None:
    def done() -> bool:
        phases = [s.get("phase") for s in statuses(cluster, namespace).values()]
        assert "Failed" not in phases, statuses(cluster, namespace)
        return len(phases) == count and all(p == "Succeeded" for p in phases)

    wait_for(f"{count} jobs to succeed", done, timeout=timeout, interval=1)


def assert_one_launch_each(cluster: Cluster, namespace: str, log: JobLog) -> None:
    seen = log.jobs_by_owner()
    final = statuses(cluster, namespace)
    for name, status in final.items():
        assert seen.get(name) and {n for n, _ in seen[name]} == {f"{name}-a1"}, (name, seen)
        assert len(seen[name]) == 1, f"{name}: its batch Job was created twice: {seen[name]}"
        assert status.get("attempt") == 1 and status.get("restarts", 0) == 0, (name, status)


# ---------------------------------------------------------------------- killed


def test_standby_takes_over_when_the_leader_is_killed(
    cluster: Cluster, namespace: str, replicas: Replicas, tmp_path: Path
) -> None:
    batch_jobs = JobLog(cluster.local, namespace, tmp_path / "jobs.json")
    pid_a = replicas.start("operator-a")
    replicas.wait_leader("operator-a")
    replicas.start("operator-b")
    replicas.wait_standing_by("operator-b")

    first, second = jobs("early", 25), jobs("late", 25)
    assert cluster.apply(*first, namespace=namespace).returncode == 0
    # Kill the leader in the middle of the work: some jobs have a status, others none yet.
    wait_for(
        "the leader to be at work",
        lambda: sum(1 for s in statuses(cluster, namespace).values() if s.get("phase")) >= 5,
        timeout=60,
        interval=0.2,
    )
    killed = time.time()
    os.kill(pid_a, signal.SIGKILL)
    # Jobs created after the kill can only get a status from the new leader.
    assert cluster.apply(*second, namespace=namespace).returncode == 0
    # What the dead leader left; any change to it is the new leader's.
    left = statuses(cluster, namespace)
    took_lease = replicas.wait_leader("operator-b", timeout=TAKEOVER_LIMIT_S + 10) - killed

    def new_write() -> bool:
        now = statuses(cluster, namespace)
        return any(status != left.get(name, {}) for name, status in now.items())

    wait_for("the new leader's first status write", new_write, TAKEOVER_LIMIT_S + 10, 0.2)
    first_write = time.time() - killed
    print(
        f"\nfailover after SIGKILL: lease taken over after {took_lease:.1f}s, first status "
        f"write after {first_write:.1f}s (lease {DURATION_S}s, renew deadline "
        f"{RENEW_DEADLINE_S}s, retry {RETRY_S}s)"
    )
    assert first_write <= TAKEOVER_LIMIT_S
    # The killed leader renewed at most about one retry period before it died.
    assert took_lease >= DURATION_S - RETRY_S - 1, "taken over before the lease expired"

    wait_all_succeeded(cluster, namespace, 50, timeout=150)
    assert_one_launch_each(cluster, namespace, batch_jobs)
    assert replicas.exit_status("operator-b") is None
    lease = cluster.get("lease", LEASE, namespace)
    assert lease is not None and lease["spec"]["leaseTransitions"] == 1


# ---------------------------------------------------------------------- stopped


def test_a_stopped_leader_releases_the_lease(
    cluster: Cluster, namespace: str, replicas: Replicas
) -> None:
    replicas.start("operator-a")
    replicas.wait_leader("operator-a")
    replicas.start("operator-b")
    replicas.wait_standing_by("operator-b")
    stopped = time.time()
    os.kill(replicas.local.state.pids["operator-a"], signal.SIGTERM)
    handover = replicas.wait_leader("operator-b", timeout=30) - stopped
    wait_for("operator-a to exit", lambda: replicas.exit_status("operator-a") is not None, 30)
    print(f"\nhandover after SIGTERM: {handover:.1f}s")
    assert replicas.exit_status("operator-a") == 0
    assert "released the lease" in replicas.log("operator-a")
    assert handover < DURATION_S, "the standby waited for the lease to expire"
    # The new leader works.
    assert cluster.apply(job_doc("after-handover"), namespace=namespace).returncode == 0
    wait_all_succeeded(cluster, namespace, 1, timeout=60)


# ---------------------------------------------------------------------- partitioned


def proxied_kubeconfig(local: LocalCluster, proxy: TcpProxy, path: Path) -> Path:
    config = yaml.safe_load(local.kubeconfig.read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_partitioned_leader_fences_itself(
    cluster: Cluster, namespace: str, replicas: Replicas, tmp_path: Path
) -> None:
    local = cluster.local
    with TcpProxy(("127.0.0.1", local.state.apiserver_port)) as proxy:
        replicas.start("operator-p", kubeconfig=proxied_kubeconfig(local, proxy, tmp_path / "kc"))
        replicas.wait_leader("operator-p")
        replicas.start("operator-q")
        replicas.wait_standing_by("operator-q")
        early = jobs("part", 10)
        assert cluster.apply(*early, namespace=namespace).returncode == 0
        wait_for(
            "the leader to be at work",
            lambda: any(s.get("phase") for s in statuses(cluster, namespace).values()),
            timeout=60,
            interval=0.2,
        )
        assert proxy.connections > 0
        severed = time.time()
        proxy.sever()
        wait_for(
            "the partitioned leader to exit",
            lambda: replicas.exit_status("operator-p") is not None,
            timeout=RENEW_DEADLINE_S + 10,
            interval=0.05,
        )
        exited = time.time() - severed
        took_lease = replicas.wait_leader("operator-q", timeout=30) - severed
    print(
        f"\npartition: the cut-off leader exited {exited:.1f}s after the cut (renew deadline "
        f"{RENEW_DEADLINE_S}s); the other replica held the lease after {took_lease:.1f}s"
    )
    assert replicas.exit_status("operator-p") == EXIT_LEASE_LOST
    assert "lost the lease" in replicas.log("operator-p")
    assert exited <= RENEW_DEADLINE_S + 2
    # Seen exiting (within 50 ms) before the other replica acquired the lease.
    assert took_lease > exited, "a second leader while the first could still write"
    late = jobs("after", 5)
    assert cluster.apply(*late, namespace=namespace).returncode == 0
    wait_all_succeeded(cluster, namespace, 15, timeout=120)
