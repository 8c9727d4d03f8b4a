"""What one FineTuneJob write costs the API server: CPU per request, against a ConfigMap.

Every status write of the operator is a PATCH of a custom resource. The API server decodes
the stored object, applies the patch, validates the whole object against the CRD's schema
(its CEL rules included, with ratcheting against the old object), updates managedFields
with the schema's types, encodes it and writes it to etcd; a ConfigMap of the same bytes
skips the schema. On a small control plane these CPU seconds are what a burst of jobs
waits for, so this benchmark measures them:

1. starts the local control plane (docs/local-cluster.md) with the simulated GPU pools and
   runs one FineTuneJob through the operator, so the object carries a status and
   managedFields as the operator writes them; then stops the operator;
2. makes a ConfigMap holding the job's spec and status as text (about the same bytes);
3. sends `--requests` of each request one after another from one client, and reads the CPU
   time of kube-apiserver and etcd from /proc before and after: PATCH of the job's status
   (its message), PATCH of the job's metadata (an annotation), PATCH of the ConfigMap,
   GET of each, and POST of a core/v1 Event about the job as the operator posts one;
4. repeats with the objects grown about four times (an annotation of padding on each), to
   see how the cost follows the bytes;
5. does all of it again on a fresh control plane for each CRD variant: as shipped, without
   its CEL rules, and with the status schema open (`x-kubernetes-preserve-unknown-fields`,
   no rules), to see which part of the cost is the schema's.

Nothing else runs against the API server meanwhile but the control plane's own
components (kwok's node heartbeats among them), so the numbers include a little of their
work; `background` rows measure that (CPU per second with no requests sent).

Prints a table and appends it, dated, to benchmarks/results/apiserver-write-cost-<date>.md.

Usage: python -m benchmarks.apiserver_write_cost [--requests N] [--out FILE | --no-write]
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import math
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.measure import load_average, proc_sample
from benchmarks.operator_scale.api import Api, OwnRequests
from benchmarks.operator_scale.scenario import GROUP, VERSION, JobPlan, pool_docs

RESULTS = Path(__file__).resolve().parent / "results"
NAMESPACE = "write-cost"
PAD_FACTOR = 4
"""The grown objects carry padding of (this - 1) × their own size."""


@dataclass(frozen=True)
class Row:
    crd: str
    size: str
    request: str
    object_bytes: int
    requests: int
    wall_ms: float
    apiserver_ms: float
    etcd_ms: float


def say(msg: str) -> None:
    print(msg, flush=True)


def strip_key(node: Any, key: str) -> None:
    """Remove `key` from every mapping in a nested document, in place."""
    if isinstance(node, dict):
        node.pop(key, None)
        for value in node.values():
            strip_key(value, key)
    elif isinstance(node, list):
        for value in node:
            strip_key(value, key)


def crd_variants(docs: list[dict[str, Any]]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The CRDs as shipped, without CEL rules, and with the FineTuneJob status open."""
    yield "as shipped", docs
    no_rules = copy.deepcopy(docs)
    for doc in no_rules:
        strip_key(doc, "x-kubernetes-validations")
    yield "no CEL rules", no_rules
    open_status = copy.deepcopy(no_rules)
    for doc in open_status:
        if doc["spec"]["names"]["kind"] == "FineTuneJob":
            for version in doc["spec"]["versions"]:
                props = version["schema"]["openAPIV3Schema"]["properties"]
                props["status"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    yield "no CEL rules, status open", open_status


def job_event(job: Mapping[str, Any], i: int, at: dt.datetime) -> dict[str, Any]:
    """A core/v1 Event about `job` as the operator posts one (through kopf): a new object
    each time, named by the API server, with the fields kopf fills."""
    meta = job["metadata"]
    stamp = at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"namespace": meta["namespace"], "generateName": "kopf-event-"},
        "action": "Action",
        "type": "Normal",
        "reason": "PlanReady",
        "message": f"Plan r1: lora on 1×1 NVIDIA L40S (pool l40s), write {i}",
        "reportingComponent": "kopf",
        "reportingInstance": "dev",
        "source": {"component": "kopf"},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "eventTime": None,
        "involvedObject": {
            "apiVersion": job["apiVersion"],
            "kind": job["kind"],
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        },
    }


class Client:
    """Requests through the scale benchmark's HTTPS client (`Api`) that must succeed."""

    def __init__(self, api: Api) -> None:
        self.api = api

    def send(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        status, out = self.api.request(
            method, path, None, data, content_type="application/merge-patch+json"
        )
        if status != 200:
            raise RuntimeError(f"{method} {path}: HTTP {status}: {out[:300]!r}")
        return out

    def create(self, path: str, body: Mapping[str, Any]) -> bytes:
        status, out = self.api.request("POST", path, None, json.dumps(body).encode())
        if status != 201:
            raise RuntimeError(f"POST {path}: HTTP {status}: {out[:300]!r}")
        return out


class Bench:
    def __init__(self, requests: int) -> None:
        self.requests = requests
        self.rows: list[Row] = []
        self.phase = ""

    def run(self) -> list[Row]:
        from kubetune.api.crdgen import render_all

        docs = [yaml.safe_load(text) for text in render_all().values()]
        for crd, variant in crd_variants(docs):
            self.run_variant(crd, variant)
        return self.rows

    def run_variant(self, crd: str, docs: list[dict[str, Any]]) -> None:
        """A control plane of its own for each CRD variant: one that changes a CRD in place
        measured its later rows up to 40 % higher, GETs included."""
        from kubetune_dev.binaries import ensure_binaries
        from kubetune_dev.cluster import LocalCluster, default_root

        binaries = ensure_binaries(say)
        parent = default_root("write-cost").parent
        parent.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="write-cost-", dir=parent))
        cluster = LocalCluster(root, binaries, say, die_with_caller=True)
        done = False
        try:
            cluster.start()
            cluster.apply(docs)
            cluster.kubectl("wait", "--for=condition=Established", "crd", "--all")
            cluster.add_simulated_pools(pool_docs(2))
            cluster.apply(
                [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
            )
            api = Api(cluster.kubeconfig, OwnRequests())
            client = Client(api)
            job = self.job_through_operator(cluster, api, client)
            self.apiserver = cluster.state.pids["kube-apiserver"]
            self.etcd = cluster.state.pids["etcd"]
            self.background(crd)
            self.measure_all(client, job, crd)
            done = True
        finally:
            left = cluster.stop()
            say(f"WARNING: processes survived: {left}" if left else "cluster stopped")
            if done and not left:
                shutil.rmtree(root, ignore_errors=True)
            else:
                say(f"component logs: {root / 'logs'}")

    def job_path(self, name: str) -> str:
        return f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/finetunejobs/{name}"

    def job_through_operator(self, cluster: Any, api: Api, client: Client) -> str:
        """A FineTuneJob whose status and managedFields the operator wrote; its name."""
        job = JobPlan(
            NAMESPACE, "ftj-write-cost", "meta-llama/Llama-3.1-8B", "lora", 2048, 20000, 8
        )
        status, data = api.request(
            "POST",
            f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/finetunejobs",
            None,
            json.dumps(job.doc()).encode(),
        )
        if status != 201:
            raise RuntimeError(f"creating the job: HTTP {status}: {data[:300]!r}")
        cluster.start_operator({"KUBETUNE_STAGE_IN_HUB": "false"})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            obj = json.loads(client.send("GET", self.job_path(job.name)))
            self.phase = str((obj.get("status") or {}).get("phase") or "")
            if self.phase in ("Running", "Succeeded"):
                break
            time.sleep(1.0)
        else:
            raise TimeoutError(f"the job did not run within 180 s (phase {self.phase!r})")
        cluster.stop_component("operator")
        say(f"the operator took the job to {self.phase}; stopped it")
        return job.name

    def cpu(self) -> tuple[float, float]:
        return proc_sample(self.apiserver).cpu_s, proc_sample(self.etcd).cpu_s

    def spent(self, work: Callable[[], object]) -> tuple[float, float, float]:
        """Run `work`: (its seconds, kube-apiserver's and etcd's CPU seconds meanwhile)."""
        (a0, e0), t0 = self.cpu(), time.monotonic()
        work()
        (a1, e1), took = self.cpu(), time.monotonic() - t0
        return took, a1 - a0, e1 - e0

    def background(self, crd: str, seconds: float = 10.0) -> None:
        """The control plane's own CPU with nothing sent: a floor under every row."""
        time.sleep(2.0)
        took, apiserver_s, etcd_s = self.spent(lambda: time.sleep(seconds))
        row = Row(
            crd,
            "–",
            "none: background, per second",
            0,
            0,
            math.nan,
            1000 * apiserver_s / took,
            1000 * etcd_s / took,
        )
        self.rows.append(row)
        say(
            f"{crd:28s} nothing sent: kube-apiserver {row.apiserver_ms:5.1f} ms CPU per second, "
            f"etcd {row.etcd_ms:4.1f}"
        )

    def measure(
        self, crd: str, size: str, request: str, nbytes: int, send: Callable[[int], Any]
    ) -> None:
        send(0)  # the first of a kind warms caches
        n = self.requests
        took, apiserver_s, etcd_s = self.spent(lambda: [send(i) for i in range(1, n + 1)])
        row = Row(
            crd,
            size,
            request,
            nbytes,
            n,
            1000 * took / n,
            1000 * apiserver_s / n,
            1000 * etcd_s / n,
        )
        self.rows.append(row)
        say(
            f"{crd:28s} {size:6s} {request:24s} {nbytes:7d} B: {row.wall_ms:5.1f} ms wall, "
            f"kube-apiserver {row.apiserver_ms:5.1f} ms CPU, etcd {row.etcd_ms:4.1f} ms CPU"
        )

    def measure_all(self, client: Client, job: str, crd: str) -> None:
        path = self.job_path(job)
        cm_path = f"/api/v1/namespaces/{NAMESPACE}/configmaps/write-cost"
        obj = json.loads(client.send("GET", path))
        text = {"spec": json.dumps(obj["spec"]), "status": json.dumps(obj.get("status"))}
        status, data = client.api.request(
            "POST",
            f"/api/v1/namespaces/{NAMESPACE}/configmaps",
            None,
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": "write-cost"},
                    "data": text,
                }
            ).encode(),
        )
        if status != 201:
            raise RuntimeError(f"creating the ConfigMap: HTTP {status}: {data[:300]!r}")
        for size in ("as written", f"×{PAD_FACTOR}"):
            if size != "as written":
                pad = "x" * ((PAD_FACTOR - 1) * len(json.dumps(obj)))
                for p in (path, cm_path):
                    client.send("PATCH", p, {"metadata": {"annotations": {"padding": pad}}})
            job_bytes = len(client.send("GET", path))
            cm_bytes = len(client.send("GET", cm_path))
            self.measure(
                crd,
                size,
                "FineTuneJob status PATCH",
                job_bytes,
                lambda i: client.send(
                    "PATCH", path + "/status", {"status": {"message": f"write {i}"}}
                ),
            )
            self.measure(
                crd,
                size,
                "FineTuneJob metadata PATCH",
                job_bytes,
                lambda i: client.send("PATCH", path, {"metadata": {"annotations": {"n": str(i)}}}),
            )
            self.measure(
                crd, size, "FineTuneJob GET", job_bytes, lambda i: client.send("GET", path)
            )
            # The ConfigMap on every control plane: the yardstick each variant is read against.
            self.measure(
                crd,
                size,
                "ConfigMap PATCH",
                cm_bytes,
                lambda i: client.send("PATCH", cm_path, {"data": {"n": str(i)}}),
            )
            self.measure(
                crd, size, "ConfigMap GET", cm_bytes, lambda i: client.send("GET", cm_path)
            )
        # What the operator's Events cost beside its status writes: a new object each.
        events = f"/api/v1/namespaces/{NAMESPACE}/events"
        now = dt.datetime.now(dt.UTC)
        self.measure(
            crd,
            "an Event",
            "Event POST (core/v1)",
            len(client.create(events, job_event(obj, 0, now))),
            lambda i: client.create(events, job_event(obj, i, now)),
        )


def table(rows: list[Row]) -> str:
    lines = [
        "| CRD | object | request | bytes | requests | wall ms | kube-apiserver CPU ms "
        "| etcd CPU ms |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.crd} | {r.size} | {r.request} | {r.object_bytes or '–'} | "
            f"{r.requests or '–'} | {'–' if math.isnan(r.wall_ms) else f'{r.wall_ms:.1f}'} | "
            f"{r.apiserver_ms:.1f} | {r.etcd_ms:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300, help="requests of each kind (300)")
    p.add_argument(
        "--out", type=Path, help="results file (benchmarks/results/apiserver-write-cost-<date>.md)"
    )
    p.add_argument("--no-write", action="store_true", help="print only")
    a = p.parse_args(argv)
    if a.requests < 10:
        p.error("--requests must be at least 10")
    bench = Bench(a.requests)
    rows = bench.run()
    now = dt.datetime.now()
    head = (
        f"## {now:%Y-%m-%d %H:%M}: {a.requests} requests of each kind, one client, one after "
        f"another; the job {bench.phase} through the operator first\n\n"
        f"Machine: {platform.machine()}, {platform.python_version()}, "
        f"{load_average().split()[0]} load at the end. CPU per request "
        "from /proc (user + system) of kube-apiserver and etcd; wall: the client's time "
        "per request.\n\n"
    )
    text = head + table(rows)
    say(text)
    if not a.no_write:
        out = a.out or RESULTS / f"apiserver-write-cost-{now:%Y-%m-%d}.md"
        if not out.exists():
            out.write_text(
                f"# What one FineTuneJob write costs the API server — {now:%Y-%m-%d}\n\n"
                "Made by `python -m benchmarks.apiserver_write_cost` (its docstring says how).\n\n"
            )
        with out.open("a") as fh:
            fh.write(text + "\n")
        say(f"appended to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
