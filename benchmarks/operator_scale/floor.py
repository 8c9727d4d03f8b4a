"""The floors a run compares the operator with, each a process of its own beside the
cluster: the independent watch (`first_events`: when the API server delivers each new job to
a watch, the floor under creation → Planned), and the minimal writer (`planned_floor_writer`:
the least an operator that writes Planned, and launches, can do)."""

from __future__ import annotations

import datetime as dt
import http.client
import json
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.operator_scale.api import Api, OwnRequests, Watch
from benchmarks.operator_scale.scenario import GROUP, LABEL_JOB, VERSION, pool_docs


def first_events(kubeconfig: Path, out: Path) -> None:
    """Run as a process of its own (`--first-events`) until killed: write when a watch of
    FineTuneJobs first shows each job, one JSON line per job, after a first line once the
    watch's initial list is done. Nothing else shares this process, so the times are the API
    server's delivery of watch events, apart from the operator's event handling and from the
    benchmark's own creating clients."""
    api = Api(kubeconfig, OwnRequests())
    seen: set[str] = set()
    lock = threading.Lock()  # the watch's thread and this one both write lines
    with out.open("w", buffering=1) as f:

        def write(record: Mapping[str, Any]) -> None:
            with lock:
                f.write(json.dumps(record) + "\n")

        def on_event(kind: str, obj: Mapping[str, Any]) -> None:
            meta = obj.get("metadata") or {}
            key = f"{meta.get('namespace')}/{meta.get('name')}"
            if key not in seen:
                seen.add(key)
                write({"job": key, "at": time.time()})

        watch = Watch(api, f"/apis/{GROUP}/{VERSION}/finetunejobs", "finetunejobs", on_event)
        watch.start()
        watch.synced.wait()
        write({"synced": True})
        watch.join()


PLANNED_FLOOR_WRITERS = 8
"""Threads of `planned_floor_writer`, each with its own kept-alive connection (the default
of `--floor-writers`)."""


def planned_patch(at: dt.datetime) -> bytes:
    """The one status write of `planned_floor_writer`: a Planned condition decided `at`."""
    condition = {
        "type": "Planned",
        "status": "True",
        "reason": "PlanReady",
        "message": "written by the benchmark's minimal writer (--planned-floor)",
        "lastTransitionTime": at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return json.dumps({"status": {"conditions": [condition]}}).encode()


def floor_batch_job(namespace: str, job: str, pool: Mapping[str, Any]) -> bytes:
    """The one child of a job `planned_floor_writer` launches: a batch Job of one pod that
    asks for one GPU of `pool` (a GPUPool document: its nodeSelector and tolerations), labelled
    as the operator labels a job's children, so the benchmark's watches time it alike."""
    spec = pool.get("spec") or {}
    labels = {LABEL_JOB: job}
    pod = {
        "restartPolicy": "Never",
        "nodeSelector": dict(spec.get("nodeSelector") or {}),
        "tolerations": list(spec.get("tolerations") or []),
        "containers": [
            {
                "name": "trainer",
                "image": "kubetune-trainer:launch-floor",
                "resources": {"limits": {"nvidia.com/gpu": 1}},
            }
        ],
    }
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{job}-floor", "namespace": namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    return json.dumps(body).encode()


def _send(api: Api, method: str, path: str, body: bytes, content_type: str) -> None:
    """One write of `planned_floor_writer`, retried a few times on what may pass."""
    for delay in (0.2, 0.5, 1.0, 2.0, None):
        try:
            code, data = api.request(method, path, None, body, content_type=content_type)
        except (OSError, http.client.HTTPException) as exc:
            code, data = 0, str(exc).encode()
        if code in (200, 201) or delay is None or code not in (0, 409, 429, 500, 503):
            break
        time.sleep(delay)
    if code not in (200, 201):
        print(f"planned-floor writer: {method} {path}: HTTP {code}: {data[:200]!r}", flush=True)


def planned_floor_writer(
    kubeconfig: Path, ready: Path, launches: int = 0, threads: int = PLANNED_FLOOR_WRITERS
) -> None:
    """Run as a process of its own (`--planned-floor-writer`) until killed: watch
    FineTuneJobs and write each new job's Planned condition, decided when the watch shows
    the job, with one status PATCH from `threads` threads; `ready` is written once the
    watch's initial list is done. No planning, no Events: the least an operator that writes
    the condition can do, so how late these conditions come is the floor under the
    operator's creation → Planned on this cluster.

    The first `launches` jobs it sees it also launches, just before that write: one batch
    Job each (`floor_batch_job`, the simulated pools in turn), whose pod the Job controller
    creates and kube-scheduler binds. How late those pods come is the floor under the
    operator's creation → first pod."""
    api = Api(kubeconfig, OwnRequests())
    pools = pool_docs(1)
    todo: queue.SimpleQueue[tuple[str, str, dt.datetime, int]] = queue.SimpleQueue()
    seen: set[tuple[str, str]] = set()

    def on_event(kind: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        conditions = (obj.get("status") or {}).get("conditions") or []
        if kind == "DELETED" or key in seen or any(c.get("type") == "Planned" for c in conditions):
            return
        seen.add(key)
        todo.put((*key, dt.datetime.now(dt.UTC), len(seen)))

    def write() -> None:
        while True:
            namespace, name, at, nth = todo.get()
            path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/finetunejobs/{name}/status"
            if nth <= launches:  # the pod first: creation → first pod is what it times
                body = floor_batch_job(namespace, name, pools[nth % len(pools)])
                jobs = f"/apis/batch/v1/namespaces/{namespace}/jobs"
                _send(api, "POST", jobs, body, "application/json")
            _send(api, "PATCH", path, planned_patch(at), "application/merge-patch+json")

    for i in range(threads):
        threading.Thread(target=write, name=f"writer-{i}", daemon=True).start()
    watch = Watch(api, f"/apis/{GROUP}/{VERSION}/finetunejobs", "finetunejobs", on_event)
    watch.start()
    watch.synced.wait()
    ready.write_text("synced\n")
    watch.join()
