"""Unit tests for the pure parts of the local pod runner: env, volumes, mounts, status, node."""

from __future__ import annotations

import base64
import signal
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from kubetune_dev.podrunner.api import ApiLookup
from kubetune_dev.podrunner.node import (
    default_capacity,
    lease_manifest,
    micro_time,
    node_manifest,
    node_status,
    parse_labels,
    parse_taints,
)
from kubetune_dev.podrunner.podspec import (
    NotReady,
    PodFacts,
    build_env,
    container_argv,
    expand,
    field_value,
    hosts_file,
    parse_quantity,
    resource_value,
)
from kubetune_dev.podrunner.sandbox import ExecSpec
from kubetune_dev.podrunner.status import (
    ContainerRun,
    container_status,
    exit_status,
    parse_oom_kills,
    pod_phase,
    pod_status,
    rfc3339,
    termination_grace,
    termination_message,
)
from kubetune_dev.podrunner.volumes import (
    Mount,
    VolumePlan,
    image_env,
    map_path,
    materialise,
    path_map,
    plan_mounts,
    plan_volumes,
    runtime_paths,
)

pytestmark = pytest.mark.tooling

INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
FACTS = PodFacts(
    pod_ip="127.0.100.7",
    host_ip="127.0.0.1",
    node_name="local-0",
    allocatable={"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1"},
)


class FakeLookup:
    def __init__(
        self,
        config_maps: Mapping[str, Mapping[str, str]] | None = None,
        secrets: Mapping[str, Mapping[str, str]] | None = None,
        claims: Mapping[str, str] | None = None,
    ) -> None:
        self.config_maps = {
            k: {kk: vv.encode() for kk, vv in v.items()} for k, v in (config_maps or {}).items()
        }
        self.secrets = {
            k: {kk: vv.encode() for kk, vv in v.items()} for k, v in (secrets or {}).items()
        }
        self.claims = dict(claims or {})
        self.tokens: list[tuple[str | None, int]] = []

    def config_map(self, namespace: str, name: str) -> dict[str, bytes] | None:
        return self.config_maps.get(name)

    def secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        return self.secrets.get(name)

    def claim_path(self, namespace: str, claim: str) -> str:
        if claim not in self.claims:
            raise NotReady("FailedMount", f'persistentvolumeclaim "{claim}" is not bound yet')
        return self.claims[claim]

    def token(self, pod: Mapping[str, Any], audience: str | None, expiration: int) -> str:
        self.tokens.append((audience, expiration))
        return "tok"


def make_pod(**spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "ft-a1-0-abcde",
            "namespace": "team",
            "uid": "uid-1",
            "labels": {"app": "trainer"},
            "annotations": {"batch.kubernetes.io/job-completion-index": "3"},
        },
        "spec": {"nodeName": "local-0", "containers": [{"name": "trainer"}], **spec},
    }


# ----------------------------------------------------------------------------- parsers


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2", Decimal(2)),
        ("500m", Decimal("0.5")),
        ("16Gi", Decimal(16 * 2**30)),
        ("1k", Decimal(1000)),
        ("1e3", Decimal(1000)),
        ("1.5", Decimal("1.5")),
        ("128974848", Decimal(128974848)),
    ],
)
def test_parse_quantity(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


def test_parse_quantity_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_quantity("lots")
    with pytest.raises(ValueError):
        parse_quantity("3Qi")


def test_parse_labels_and_taints() -> None:
    assert parse_labels("a=b, pool=l40s,") == {"a": "b", "pool": "l40s"}
    assert parse_labels("") == {}
    with pytest.raises(ValueError):
        parse_labels("novalue")
    assert parse_taints("nvidia.com/gpu=present:NoSchedule,dedicated:NoExecute") == [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
        {"key": "dedicated", "effect": "NoExecute"},
    ]
    with pytest.raises(ValueError):
        parse_taints("a=b:Sometimes")


def test_parse_oom_kills() -> None:
    assert parse_oom_kills("pgfault 10\noom_kill 4\nfoo 1\n") == 4
    assert parse_oom_kills("pgfault 10\n") is None


# ----------------------------------------------------------------------------- env


@pytest.mark.parametrize(
    ("text", "out"),
    [
        ("$(A)-$(B)", "1-two"),
        ("$$(A)", "$(A)"),
        ("$(MISSING)", "$(MISSING)"),
        ("$(A", "$(A"),
        ("cost $5", "cost $5"),
        ("trailing $", "trailing $"),
        ("$$$(A)", "$1"),
    ],
)
def test_expand_follows_kubernetes_rules(text: str, out: str) -> None:
    assert expand(text, {"A": "1", "B": "two"}) == out


def test_field_values() -> None:
    pod = make_pod(serviceAccountName="trainer")
    assert field_value(pod, "metadata.name", FACTS) == "ft-a1-0-abcde"
    assert field_value(pod, "metadata.namespace", FACTS) == "team"
    assert field_value(pod, "metadata.uid", FACTS) == "uid-1"
    assert field_value(pod, INDEX_FIELD, FACTS) == "3"
    assert field_value(pod, 'metadata.labels["app"]', FACTS) == "trainer"
    assert field_value(pod, "metadata.labels['nope']", FACTS) == ""
    assert field_value(pod, "status.podIP", FACTS) == "127.0.100.7"
    assert field_value(pod, "status.hostIP", FACTS) == "127.0.0.1"
    assert field_value(pod, "spec.nodeName", FACTS) == "local-0"
    assert field_value(pod, "spec.serviceAccountName", FACTS) == "trainer"
    assert field_value(pod, "metadata.labels", FACTS) == 'app="trainer"'
    with pytest.raises(NotReady):
        field_value(pod, "spec.containers", FACTS)


def test_resource_field_ref_defaults() -> None:
    container = {"resources": {"requests": {"cpu": "1500m", "memory": "1Gi"}}}
    assert resource_value(container, {"resource": "requests.cpu"}, FACTS.allocatable) == "2"
    assert (
        resource_value(container, {"resource": "requests.cpu", "divisor": "1m"}, FACTS.allocatable)
        == "1500"
    )
    ref = {"resource": "requests.memory", "divisor": "1Mi"}
    assert resource_value(container, ref, FACTS.allocatable) == "1024"
    # An unset limit is the node's allocatable amount; an unset request with no limit is 0.
    assert resource_value(container, {"resource": "limits.cpu"}, FACTS.allocatable) == "2"
    assert resource_value({}, {"resource": "requests.nvidia.com/gpu"}, {}) == "0"
    with pytest.raises(NotReady):
        resource_value({}, {"resource": "cpu"}, {})


def test_build_env_order_sources_and_expansion() -> None:
    lookup = FakeLookup(
        config_maps={"settings": {"LR": "0.1", "MODE": "cm"}},
        secrets={"hf": {"token": "s3cret"}},
    )
    container = {
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
        "env": [
            {"name": "A", "value": "a"},
            {"name": "B", "value": "$(A)-$(CFG_LR)-$(LATER)"},
            {"name": "LATER", "value": "x"},
            {
                "name": "NODE_RANK",
                "valueFrom": {"fieldRef": {"fieldPath": INDEX_FIELD}},
            },
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {
                "name": "MODE",
                "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "MODE"}},
            },
            {
                "name": "OPT",
                "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k", "optional": True}},
            },
            {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
        ],
    }
    env = build_env(make_pod(), container, lookup, FACTS)
    assert env == {
        "CFG_LR": "0.1",
        "CFG_MODE": "cm",
        "A": "a",
        "B": "a-0.1-$(LATER)",
        "LATER": "x",
        "NODE_RANK": "3",
        "POD_IP": "127.0.100.7",
        "HF_TOKEN": "s3cret",
        "MODE": "cm",
        "CPUS": "2",
    }


@pytest.mark.parametrize(
    "item",
    [
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}},
        {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "nokey"}}},
    ],
)
def test_build_env_missing_source_is_not_ready(item: dict[str, Any]) -> None:
    lookup = FakeLookup(config_maps={"settings": {"A": "1"}})
    with pytest.raises(NotReady) as err:
        build_env(make_pod(), {"env": [item]}, lookup, FACTS)
    assert err.value.reason == "CreateContainerConfigError"


def test_build_env_missing_env_from() -> None:
    container = {"envFrom": [{"secretRef": {"name": "gone"}}]}
    with pytest.raises(NotReady, match='secret "gone" not found'):
        build_env(make_pod(), container, FakeLookup(), FACTS)
    optional = {"envFrom": [{"secretRef": {"name": "gone", "optional": True}}]}
    assert build_env(make_pod(), optional, FakeLookup(), FACTS) == {}


def test_container_argv() -> None:
    container = {"command": ["torchrun"], "args": ["--nnodes=$(N)", "-m", "x", "$$(N)"]}
    assert container_argv(container, {"N": "2"}) == ["torchrun", "--nnodes=2", "-m", "x", "$(N)"]
    with pytest.raises(NotReady) as err:
        container_argv({"name": "c", "args": ["x"]}, {})
    assert err.value.reason == "StartError"


# ----------------------------------------------------------------------------- volumes


def test_plan_volumes_of_a_trainer_pod(tmp_path: Path) -> None:
    pod = make_pod(
        volumes=[
            {"name": "config", "configMap": {"name": "ft-a1"}},
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ft-ckpt"}},
            {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
            {"name": "tmp", "emptyDir": {}},
            {
                "name": "creds",
                "secret": {
                    "secretName": "hf",
                    "items": [{"key": "token", "path": "hub/token", "mode": 0o600}],
                    "defaultMode": 0o400,
                },
            },
            {"name": "host", "hostPath": {"path": "/srv/data", "type": "Directory"}},
        ]
    )
    lookup = FakeLookup(
        config_maps={"ft-a1": {"config.json": "{}"}},
        secrets={"hf": {"token": "t", "other": "o"}},
        claims={"ft-ckpt": "/vol/pvc-1", "models": "/vol/pvc-2"},
    )
    plans = plan_volumes(pod, tmp_path, lookup, FACTS)
    assert plans["config"] == VolumePlan(
        "config",
        "configMap",
        str(tmp_path / "volumes/config"),
        files={"config.json": (b"{}", 0o644)},
        read_only=True,
        owned=True,
    )
    assert plans["checkpoints"].path == "/vol/pvc-1"
    assert not plans["checkpoints"].read_only
    assert plans["model"].read_only
    assert plans["dshm"].path == str(tmp_path / "volumes/dshm")
    assert plans["dshm"].create == "dir" and plans["dshm"].owned
    assert plans["creds"].files == {"hub/token": (b"t", 0o600)}
    assert plans["host"].path == "/srv/data" and plans["host"].check == "dir"


def test_plan_volumes_waits_for_what_is_missing(tmp_path: Path) -> None:
    claim = make_pod(volumes=[{"name": "c", "persistentVolumeClaim": {"claimName": "x"}}])
    with pytest.raises(NotReady, match="not bound"):
        plan_volumes(claim, tmp_path, FakeLookup(), FACTS)
    cm = make_pod(volumes=[{"name": "c", "configMap": {"name": "absent"}}])
    with pytest.raises(NotReady, match='configmap "absent" not found'):
        plan_volumes(cm, tmp_path, FakeLookup(), FACTS)
    optional = make_pod(volumes=[{"name": "c", "configMap": {"name": "absent", "optional": True}}])
    assert plan_volumes(optional, tmp_path, FakeLookup(), FACTS)["c"].files == {}
    nfs = make_pod(volumes=[{"name": "n", "nfs": {"server": "x", "path": "/"}}])
    with pytest.raises(NotReady, match="nfs volumes are not supported"):
        plan_volumes(nfs, tmp_path, FakeLookup(), FACTS)
    bad = make_pod(
        volumes=[
            {"name": "c", "configMap": {"name": "cm", "items": [{"key": "k", "path": "../x"}]}}
        ]
    )
    with pytest.raises(NotReady, match="invalid path"):
        plan_volumes(bad, tmp_path, FakeLookup(config_maps={"cm": {"k": "v"}}), FACTS)


def test_plan_projected_service_account_volume(tmp_path: Path) -> None:
    pod = make_pod(
        volumes=[
            {
                "name": "kube-api-access",
                "projected": {
                    "defaultMode": 0o644,
                    "sources": [
                        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                        {
                            "configMap": {
                                "name": "kube-root-ca.crt",
                                "items": [{"key": "ca.crt", "path": "ca.crt"}],
                            }
                        },
                        {
                            "downwardAPI": {
                                "items": [
                                    {
                                        "path": "namespace",
                                        "fieldRef": {"fieldPath": "metadata.namespace"},
                                    }
                                ]
                            }
                        },
                    ],
                },
            },
            {
                "name": "info",
                "downwardAPI": {
                    "items": [
                        {
                            "path": "cpu",
                            "resourceFieldRef": {
                                "containerName": "trainer",
                                "resource": "limits.cpu",
                            },
                        }
                    ]
                },
            },
        ]
    )
    lookup = FakeLookup(config_maps={"kube-root-ca.crt": {"ca.crt": "PEM"}})
    plans = plan_volumes(pod, tmp_path, lookup, FACTS)
    assert plans["kube-api-access"].files == {
        "token": (b"tok", 0o644),
        "ca.crt": (b"PEM", 0o644),
        "namespace": (b"team", 0o644),
    }
    assert lookup.tokens == [(None, 3607)]
    assert plans["info"].files == {"cpu": (b"2", 0o644)}


def test_materialise_writes_files_and_folders(tmp_path: Path) -> None:
    files = VolumePlan(
        "c",
        "secret",
        str(tmp_path / "v/c"),
        files={"a/b": (b"x", 0o600), "top": (b"y", 0o644)},
        read_only=True,
        owned=True,
    )
    materialise(files)
    assert (tmp_path / "v/c/a/b").read_bytes() == b"x"
    assert (tmp_path / "v/c/a/b").stat().st_mode & 0o777 == 0o600
    empty = VolumePlan("e", "emptyDir", str(tmp_path / "v/e"), create="dir", owned=True)
    materialise(empty)
    assert (tmp_path / "v/e").is_dir()
    must = VolumePlan("h", "hostPath", str(tmp_path / "nope"), check="dir")
    with pytest.raises(NotReady, match="not a directory"):
        materialise(must)
    touch = VolumePlan("f", "hostPath", str(tmp_path / "d/file"), create="file")
    materialise(touch)
    assert (tmp_path / "d/file").is_file()


def test_plan_mounts_orders_parents_first_and_adds_hosts_and_termination_log() -> None:
    volumes = {
        "data": VolumePlan("data", "persistentVolumeClaim", "/vol/pvc-1"),
        "cfg": VolumePlan("cfg", "configMap", "/w/volumes/cfg", files={}, read_only=True),
    }
    container = {
        "volumeMounts": [
            {"name": "data", "mountPath": "/mnt/pvc/data/sub", "subPath": "a/b"},
            {"name": "data", "mountPath": "/mnt", "readOnly": True},
            {"name": "cfg", "mountPath": "/etc/kubetune"},
            {"name": "data", "mountPath": "/per-pod", "subPathExpr": "$(POD)"},
        ],
        "terminationMessagePath": "/tmp/term",
    }
    mounts = plan_mounts(
        container, volumes, {"POD": "p-0"}, hosts_file="/w/hosts", termination_file="/w/term"
    )
    assert mounts == [
        Mount("/vol/pvc-1", "/mnt", True),
        Mount("/vol/pvc-1/p-0", "/per-pod", False),
        Mount("/w/volumes/cfg", "/etc/kubetune", True),
        Mount("/w/hosts", "/etc/hosts", False),
        Mount("/w/term", "/tmp/term", False),
        Mount("/vol/pvc-1/a/b", "/mnt/pvc/data/sub", False),
    ]
    default_term = plan_mounts({}, {}, {}, hosts_file=None, termination_file="/w/t")
    assert default_term == [Mount("/w/t", "/dev/termination-log")]
    with pytest.raises(NotReady):
        plan_mounts(
            {"volumeMounts": [{"name": "x", "mountPath": "/x"}]},
            {},
            {},
            hosts_file=None,
            termination_file="/t",
        )


def test_hosts_file_names_the_pod_and_its_siblings() -> None:
    pod = make_pod(
        hostname="ft-a1-0", subdomain="ft", hostAliases=[{"ip": "10.1.1.1", "hostnames": ["hub"]}]
    )
    text = hosts_file(pod, "127.0.100.2", {"ft-a1-0": "127.0.100.2", "ft-a1-1": "127.0.100.3"})
    assert "127.0.0.1\tlocalhost\n" in text
    assert "127.0.100.2\tft-a1-0.ft.team.svc.cluster.local\tft-a1-0.ft\tft-a1-0\n" in text
    assert "127.0.100.3\tft-a1-1.ft.team.svc.cluster.local\tft-a1-1.ft\n" in text
    assert "10.1.1.1\thub\n" in text
    plain = hosts_file(make_pod(), "127.0.100.9", {})
    assert plain.endswith("127.0.100.9\tft-a1-0-abcde\n")


def test_path_map_translation() -> None:
    mounts = [Mount("/w/v/ckpt", "/checkpoints"), Mount("/w/v/tmp", "/tmp")]
    mapping = path_map(mounts)
    assert map_path("/checkpoints/step-10", mapping) == "/w/v/ckpt/step-10"
    assert map_path("/checkpoints", mapping) == "/w/v/ckpt"
    assert map_path("/checkpointsX", mapping) == "/checkpointsX"
    assert map_path("/", mapping) == "/"


def test_exec_spec_round_trip() -> None:
    spec = ExecSpec(
        argv=["sh", "-c", "true"],
        env={"A": "1"},
        cwd=None,
        hostname="p",
        mounts=[Mount("/a", "/b", True)],
        namespace=True,
        created_file="/c",
        error_file="/e",
        parent_pid=1,
    )
    assert ExecSpec.from_json(spec.to_json()) == spec


# ----------------------------------------------------------------------------- status


@pytest.mark.parametrize(
    ("returncode", "oom", "expected"),
    [
        (0, False, (0, "Completed", None)),
        (3, False, (3, "Error", None)),
        (42, True, (42, "Error", None)),
        (-signal.SIGTERM, False, (143, "Error", 15)),
        (-signal.SIGKILL, False, (137, "Error", 9)),
        (-signal.SIGKILL, True, (137, "OOMKilled", 9)),
    ],
)
def test_exit_status(returncode: int, oom: bool, expected: tuple[int, str, int | None]) -> None:
    assert exit_status(returncode, oom=oom) == expected


def run(name: str, state: str, code: int | None = None, reason: str = "") -> ContainerRun:
    return ContainerRun(
        name,
        image="img",
        state=state,
        reason=reason,
        exit_code=code,
        started_at="2026-01-01T00:00:00Z" if state != "waiting" else None,
        finished_at="2026-01-01T00:01:00Z" if state == "terminated" else None,
    )


def test_pod_phase() -> None:
    assert pod_phase([], [run("a", "waiting")]) == "Pending"
    assert pod_phase([run("i", "running")], [run("a", "waiting")]) == "Pending"
    assert pod_phase([run("i", "terminated", 1)], [run("a", "waiting")]) == "Failed"
    assert pod_phase([], [run("a", "running"), run("b", "terminated", 0)]) == "Running"
    assert pod_phase([], [run("a", "terminated", 0), run("b", "terminated", 0)]) == "Succeeded"
    assert pod_phase([], [run("a", "terminated", 0), run("b", "terminated", 2)]) == "Failed"


def test_container_status_shapes() -> None:
    waiting = container_status(ContainerRun("c", image="i", message="configmap missing"))
    assert waiting["state"] == {
        "waiting": {"reason": "ContainerCreating", "message": "configmap missing"}
    }
    assert waiting["ready"] is False and waiting["started"] is False
    running = ContainerRun("c", image="i", state="running", started_at="T0", container_id="x")
    status = container_status(running)
    assert status["state"] == {"running": {"startedAt": "T0"}}
    assert status["ready"] and status["started"] and status["containerID"] == "x"
    done = run("c", "terminated", 137, "OOMKilled")
    done.signal, done.message = 9, "out of memory"
    term = container_status(done)["state"]["terminated"]
    assert term == {
        "exitCode": 137,
        "reason": "OOMKilled",
        "startedAt": "2026-01-01T00:00:00Z",
        "finishedAt": "2026-01-01T00:01:00Z",
        "message": "out of memory",
        "signal": 9,
    }
    init_done = container_status(run("i", "terminated", 0, "Completed"), init=True)
    assert init_done["ready"] is True


def test_pod_status_running_then_failed_keeps_transition_times() -> None:
    pod = make_pod()
    status = pod_status(
        pod,
        [],
        [run("trainer", "running")],
        pod_ip="127.0.100.2",
        host_ip="127.0.0.1",
        start_time="T0",
        now="T1",
    )
    assert status["phase"] == "Running"
    assert status["podIP"] == "127.0.100.2" and status["podIPs"] == [{"ip": "127.0.100.2"}]
    assert status["hostIPs"] == [{"ip": "127.0.0.1"}]
    assert status["startTime"] == "T0"
    conds = {c["type"]: c for c in status["conditions"]}
    assert {k: c["status"] for k, c in conds.items()} == {
        "PodReadyToStartContainers": "True",
        "Initialized": "True",
        "Ready": "True",
        "ContainersReady": "True",
        "PodScheduled": "True",
    }
    assert "initContainerStatuses" not in status
    pod["status"] = status
    done = pod_status(
        pod,
        [],
        [run("trainer", "terminated", 3, "Error")],
        pod_ip="127.0.100.2",
        host_ip="127.0.0.1",
        start_time="T0",
        now="T2",
    )
    assert done["phase"] == "Failed"
    after = {c["type"]: c for c in done["conditions"]}
    assert after["Ready"]["status"] == "False" and after["Ready"]["reason"] == "PodCompleted"
    assert after["Ready"]["lastTransitionTime"] == "T2"
    assert after["Initialized"]["lastTransitionTime"] == "T1"  # unchanged status keeps its time
    assert done["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3


def test_pod_status_with_init_containers() -> None:
    status = pod_status(
        make_pod(),
        [run("init", "running")],
        [ContainerRun("trainer", reason="PodInitializing")],
        pod_ip="ip",
        host_ip="h",
        start_time="T0",
        now="T1",
    )
    assert status["phase"] == "Pending"
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Initialized"]["status"] == "False"
    assert conds["Initialized"]["reason"] == "ContainersNotInitialized"
    assert status["initContainerStatuses"][0]["state"] == {
        "running": {"startedAt": "2026-01-01T00:00:00Z"}
    }
    assert status["containerStatuses"][0]["state"] == {"waiting": {"reason": "PodInitializing"}}


def test_termination_message_and_fallback_to_logs() -> None:
    assert termination_message(b"bye\n", b"log", policy="File", exit_code=1) == "bye\n"
    assert termination_message(b"", b"log", policy="File", exit_code=1) == ""
    logs = b"\n".join(f"line {i}".encode() for i in range(200))
    msg = termination_message(b"", logs, policy="FallbackToLogsOnError", exit_code=1)
    assert msg.endswith("line 199") and "line 119" not in msg
    assert termination_message(b"", logs, policy="FallbackToLogsOnError", exit_code=0) == ""
    assert len(termination_message(b"x" * 10000, b"", policy="File", exit_code=0)) == 4096


def test_termination_grace() -> None:
    pod = make_pod(terminationGracePeriodSeconds=120)
    assert termination_grace(pod) == 120
    pod["metadata"]["deletionGracePeriodSeconds"] = 5
    assert termination_grace(pod) == 5
    assert termination_grace(make_pod()) == 30


# ----------------------------------------------------------------------------- node


def test_node_manifest_status_and_lease() -> None:
    capacity = default_capacity("4", "16Gi", gpus=8)
    assert capacity == {
        "cpu": "4",
        "memory": "16Gi",
        "pods": "110",
        "ephemeral-storage": "100Gi",
        "nvidia.com/gpu": "8",
    }
    assert "nvidia.com/gpu" not in default_capacity("4", "16Gi", gpus=0)
    node = node_manifest(
        "local-0",
        {"nvidia.com/gpu.product": "NVIDIA-L40S"},
        [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}],
    )
    labels = node["metadata"]["labels"]
    assert labels["kubernetes.io/hostname"] == "local-0"
    # Labels copied from a simulated pool node do not rename the node.
    copied = node_manifest("local-0", {"kubernetes.io/hostname": "l40s-0"}, [])
    assert copied["metadata"]["labels"]["kubernetes.io/hostname"] == "local-0"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-L40S"
    assert "kwok.x-k8s.io/node" not in node["metadata"].get("annotations", {})
    assert node["spec"]["taints"] == [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]
    status = node_status(capacity, host_ip="127.0.0.1", name="local-0", now="T2", since="T1")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    assert ready["lastHeartbeatTime"] == "T2" and ready["lastTransitionTime"] == "T1"
    assert status["allocatable"] == capacity
    assert {"type": "InternalIP", "address": "127.0.0.1"} in status["addresses"]
    lease = lease_manifest("local-0", "uid-9", "2026-01-01T00:00:00.000000Z", 40)
    assert lease["metadata"]["namespace"] == "kube-node-lease"
    assert lease["metadata"]["ownerReferences"][0]["uid"] == "uid-9"
    assert lease["spec"] == {
        "holderIdentity": "local-0",
        "leaseDurationSeconds": 40,
        "renewTime": "2026-01-01T00:00:00.000000Z",
    }


def test_time_formats() -> None:
    assert rfc3339(0) == "1970-01-01T00:00:00Z"
    assert micro_time(1.5) == "1970-01-01T00:00:01.500000Z"


def test_secret_lookup_decodes_base64() -> None:
    class FakeApi:
        def get(self, path: str) -> dict[str, Any] | None:
            if path.endswith("/secrets/hf"):
                return {"data": {"token": base64.b64encode(b"abc").decode()}}
            if path.endswith("/configmaps/cm"):
                return {"data": {"a": "1"}, "binaryData": {"b": base64.b64encode(b"\x00").decode()}}
            return None

    lookup = ApiLookup(FakeApi(), Path("/vr"))  # type: ignore[arg-type]
    assert lookup.secret("ns", "hf") == {"token": b"abc"}
    assert lookup.config_map("ns", "cm") == {"a": b"1", "b": b"\x00"}
    assert lookup.secret("ns", "nope") is None


def test_claim_lookup_resolves_bound_pv() -> None:
    objects: dict[str, dict[str, Any]] = {
        "/api/v1/namespaces/ns/persistentvolumeclaims/bound": {
            "spec": {"volumeName": "pv-1"},
            "status": {"phase": "Bound"},
        },
        "/api/v1/namespaces/ns/persistentvolumeclaims/pending": {
            "spec": {},
            "status": {"phase": "Pending"},
        },
        "/api/v1/namespaces/ns/persistentvolumeclaims/nfs": {
            "spec": {"volumeName": "pv-2"},
            "status": {"phase": "Bound"},
        },
        "/api/v1/persistentvolumes/pv-1": {"spec": {"hostPath": {"path": "/v/pv-1"}}},
        "/api/v1/persistentvolumes/pv-2": {"spec": {"nfs": {"server": "s", "path": "/"}}},
    }

    class FakeApi:
        def get(self, path: str) -> dict[str, Any] | None:
            return objects.get(path)

    lookup = ApiLookup(FakeApi(), Path("/vr"))  # type: ignore[arg-type]
    assert lookup.claim_path("ns", "bound") == "/v/pv-1"
    assert lookup.claim_path("ns", "nfs") == "/vr/pv-2"
    with pytest.raises(NotReady, match="not bound"):
        lookup.claim_path("ns", "pending")
    with pytest.raises(NotReady, match="not found"):
        lookup.claim_path("ns", "missing")


def test_runtime_paths_under_a_volume_stay_visible() -> None:
    volumes = {"tmp": VolumePlan(name="tmp", kind="emptyDir", path="/w/tmp")}
    container = {"volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}
    mounts = plan_mounts(
        container,
        volumes,
        {},
        hosts_file=None,
        termination_file="/w/t",
        keep_visible=["/tmp/ci/.venv", "/usr", "/tmp"],
    )
    by_target = {m.target: m for m in mounts}
    # The virtualenv under /tmp is bound back read-only after the emptyDir; /usr needs nothing.
    assert by_target["/tmp/ci/.venv"] == Mount("/tmp/ci/.venv", "/tmp/ci/.venv", True)
    assert "/usr" not in by_target
    order = [m.target for m in mounts]
    assert order.index("/tmp") < order.index("/tmp/ci/.venv")


def test_pods_get_the_cached_llama_cpp_converter_the_image_would_have(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer image has llama.cpp's converter in /opt/llama.cpp; pods run here get the
    one `kubetune_dev.llamacpp` cached, and nothing while it is not (fully) built."""
    from kubetune_dev import llamacpp

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert "KUBETUNE_LLAMA_CPP_DIR" not in image_env()
    converter = llamacpp.cache_root() / "converter"
    converter.mkdir(parents=True)
    (converter / "convert_hf_to_gguf.py").write_text("")
    assert image_env() == {}  # extracted, but the build has not finished
    (llamacpp.cache_root() / llamacpp.MANIFEST_NAME).write_text('{"build_seconds": 1}')
    (llamacpp.cache_root() / llamacpp.STAMP_NAME).write_text("")
    assert image_env() == {"KUBETUNE_LLAMA_CPP_DIR": str(converter)}
    assert str(converter) in runtime_paths()  # bound back where a volume would hide it
