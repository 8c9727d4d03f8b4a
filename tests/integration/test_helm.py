"""The Helm chart against a real kube-apiserver, and the operator running with only its RBAC.

`helm install` puts the chart into the local control plane; the checks then use the objects
the API server holds. The operator itself runs as a local `kubetune operator` process with
the command line and environment of the chart's Deployment, authenticated as the chart's
ServiceAccount (a
token from the TokenRequest API), so every call it makes is authorized by the chart's
(Cluster)Roles and nothing else. A FineTuneJob going from apply to Succeeded on the
simulated pools proves those rules are enough; tests/integration/test_chart_render.py
proves they hold no wildcard.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetune_dev.binaries import Binaries
from kubetune_dev.cluster import LocalCluster, free_port
from support.cluster import Cluster, job_doc, operators_paused, wait_phase
from support.helm import Helm
from support.podsecurity import ENFORCE, REFUSED, RESTRICTED_LABELS, restricted_namespace
from support.waiting import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/kubetune"
RELEASE_NS = "kubetune-system"
TRAINER_IMAGE = "kubetune/trainer:chart-rbac"  # tells the chart's operator's work apart

# A pool from values; priced so the planner never picks it (it has no nodes).
CHART_POOL = {
    "name": "chart-h200",
    "spec": {
        "nodeSelector": {"kubetune.io/pool": "chart-h200"},
        "gpu": {"product": "NVIDIA-H200", "memoryGiB": 141, "bf16TFLOPS": 989},
        "gpusPerNode": 8,
        "maxNodes": 1,
        "pricePerGPUHour": 999.0,
    },
}


def helm(local: LocalCluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return Helm(local.binaries.helm, f"--kubeconfig={local.kubeconfig}")(*args, check=check)


def manifest(local: LocalCluster, release: str) -> list[dict[str, Any]]:
    text = helm(local, "get", "manifest", release, "-n", RELEASE_NS).stdout
    return [d for d in yaml.safe_load_all(text) if d]


def install(local: LocalCluster, release: str, values: dict[str, Any], tmp: Path) -> None:
    path = tmp / f"{release}.yaml"
    path.write_text(yaml.safe_dump(values))
    # The session's cluster has the CRDs already, applied server-side by the fixture as
    # `kubetune dev up` does: --take-ownership adopts them and --force-conflicts takes over
    # their fields, as docs/install.md tells users who applied the CRDs by hand.
    helm(
        local,
        "upgrade",
        "--install",
        release,
        str(CHART),
        "-n",
        RELEASE_NS,
        "--create-namespace",
        "--take-ownership",
        "--force-conflicts",
        "-f",
        str(path),
    )


def service_account_kubeconfig(cluster: Cluster, sa: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount, and only as it."""
    token = cluster.kubectl("create", "token", sa, "-n", RELEASE_NS, "--duration=2h").stdout.strip()
    local = cluster.local
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": local.server,
                    "certificate-authority": str(local.pki.ca_cert),
                },
            }
        ],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": "local", "user": sa}}],
        "current-context": sa,
    }
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def chart_operator(
    cluster: Cluster,
    docs: list[dict[str, Any]],
    kubeconfig: Path,
    log: Path,
    pod: str | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run the chart's operator container command locally, with the container's env.

    `pod` is the pod name the downward API would give it (POD_NAME); POD_NAMESPACE is the
    release namespace.
    """
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kubetune"]
    # A real free port for the probe endpoint, as each pod would have its own.
    health = f"http://127.0.0.1:{free_port()}/healthz"
    args = [f"--liveness={health}" if a.startswith("--liveness=") else a for a in container["args"]]
    env = dict(os.environ)
    downward = {
        "metadata.name": pod or f"chart-operator-{uuid.uuid4().hex[:6]}",
        "metadata.namespace": RELEASE_NS,
    }
    for item in container["env"]:
        field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[item["name"]] = downward[field] if field else item.get("value", "")
    env["KUBECONFIG"] = str(kubeconfig)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kubetune.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        # The liveness endpoint the chart's probe uses answers once kopf is up (or, with
        # leader election, once the replica stands by).
        wait_for("/healthz", lambda: proc.poll() is not None or _healthy(health), 30)
        assert proc.poll() is None, log.read_text()[-3000:]
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


# A 403 status, not the digits inside a port number or a millisecond timestamp.
HTTP_403 = re.compile(r"(?<![\d.:,])403(?!\d)")


def forbidden_lines(log: Path) -> list[str]:
    """The operator's log lines that say a permission was missing. A 403 for new content
    in a namespace being deleted (another test's: the chart's operator watches every
    namespace) is the API server's NamespaceTerminating refusal, not RBAC, and is left out."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [
        line
        for line in text.splitlines()
        if (
            HTTP_403.search(line) or "forbidden" in line.lower() or "Not enough permissions" in line
        )
        and "NamespaceTerminating" not in line
    ]


def can_i(cluster: Cluster, sa: str, *args: str) -> bool:
    out = cluster.kubectl(
        "auth", "can-i", *args, f"--as=system:serviceaccount:{RELEASE_NS}:{sa}", check=False
    )
    return out.stdout.strip() == "yes"


def run_job_to_success(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    cluster.apply(job_doc(name, resources={"pools": ["l40s"]}), namespace=namespace)
    obj = wait_phase(cluster, name, namespace, "Succeeded", "Failed", timeout=120)
    assert obj["status"]["phase"] == "Succeeded", obj["status"]
    batch = cluster.get("job.batch", f"{name}-a1", namespace)
    assert batch is not None
    image = batch["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == TRAINER_IMAGE, "the batch Job was not made by the chart's operator"
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"
    ).stdout
    assert "PlanReady" in events and "Launched" in events
    # Deleted while our operator runs: its loop stops (the job carries no finalizer).
    cluster.kubectl("delete", "ftj", name, "-n", namespace, "--wait=true", "--timeout=60s")
    return obj


def base_values() -> dict[str, Any]:
    return {
        "operator": {
            "trainerImage": TRAINER_IMAGE,
            "pollSeconds": 1,
            "queueRetrySeconds": 2,
            # The jobs here name a hub model, which kwok's pods never fetch: planned and
            # launched directly, as in the rest of the tier (support/cluster.FAST_OPERATOR).
            "stageInHub": False,
        },
        "metrics": {"port": free_port()},
        # No node here can run the operator pod (all are tainted GPU nodes); the test runs
        # the same container command itself.
        "nodeSelector": {"kubetune.io/operator": "none"},
    }


# ---------------------------------------------------------------------- cluster mode


@pytest.fixture(scope="module")
def release(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    local = cluster.local
    name = "kt"
    values = {**base_values(), "gpuPools": [CHART_POOL]}
    # The release namespace enforces the restricted Pod Security Standard, as hack/kind-e2e.sh
    # installs it (test_chart_pods_pass_the_restricted_pod_security_standard).
    assert cluster.apply(restricted_namespace(RELEASE_NS)).returncode == 0
    install(local, name, values, tmp_path_factory.mktemp("helm"))
    yield name
    helm(local, "uninstall", name, "-n", RELEASE_NS, "--wait", check=False)
    cluster.kubectl(
        "patch",
        "gpupool",
        CHART_POOL["name"],
        "--type=merge",
        "-p",
        '{"metadata":{"finalizers":null}}',
        check=False,
    )
    cluster.kubectl("delete", "gpupool", CHART_POOL["name"], "--ignore-not-found", check=False)


def test_install_creates_crds_rbac_and_pools(cluster: Cluster, release: str) -> None:
    docs = manifest(cluster.local, release)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"} <= kinds
    for crd in ("finetunejobs.kubetune.io", "gpupools.kubetune.io"):
        obj = cluster.get("crd", crd)
        assert obj is not None
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert obj["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        established = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
        assert established.get("Established") == "True"
    sa = f"{release}-kubetune"
    assert cluster.get("serviceaccount", sa, RELEASE_NS) is not None
    role = cluster.get("clusterrole", sa)
    assert role is not None and role["rules"]
    binding = cluster.get("clusterrolebinding", sa)
    assert binding is not None
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": RELEASE_NS}]
    deploy = cluster.get("deployment", sa, RELEASE_NS)
    assert deploy is not None
    assert cluster.get("service", f"{sa}-metrics", RELEASE_NS) is not None
    pool = cluster.get("gpupool", CHART_POOL["name"])
    assert pool is not None and pool["spec"]["pricePerGPUHour"] == 999.0


def test_service_account_can_do_what_the_operator_needs_and_no_more(
    cluster: Cluster, release: str
) -> None:
    sa = f"{release}-kubetune"
    allowed = [
        ("list", "finetunejobs.kubetune.io", "-A"),
        ("patch", "finetunejobs.kubetune.io/status", "-n", "default"),
        ("watch", "gpupools.kubetune.io"),
        ("create", "jobs.batch", "-n", "default"),
        ("list", "pods", "-A"),
        ("list", "nodes"),
        ("watch", "persistentvolumeclaims", "-A"),
        ("watch", "storageclasses.storage.k8s.io"),
        ("watch", "persistentvolumes"),
        ("create", "events", "-n", "default"),
        # The launch preflight reads a (consented) token Secret by name (rbac.secretPreflight).
        ("get", "secrets", "-n", "default"),
    ]
    for args in allowed:
        assert can_i(cluster, sa, *args), args
    denied = [
        ("list", "secrets", "-A"),
        ("watch", "secrets", "-n", "default"),
        ("delete", "pods", "-n", "default"),
        ("create", "pods", "-n", "default"),
        ("update", "deployments.apps", "-n", RELEASE_NS),
        ("delete", "gpupools.kubetune.io"),
        ("create", "clusterroles.rbac.authorization.k8s.io"),
        ("delete", "persistentvolumeclaims", "-n", "default"),
        ("patch", "nodes"),
        ("impersonate", "serviceaccounts"),
    ]
    for args in denied:
        assert not can_i(cluster, sa, *args), args


def test_operator_with_only_the_chart_rbac_runs_a_job_to_success(
    cluster: Cluster, namespace: str, release: str, tmp_path: Path
) -> None:
    local = cluster.local
    sa = f"{release}-kubetune"
    docs = manifest(local, release)
    kubeconfig = service_account_kubeconfig(cluster, sa, tmp_path / "sa.kubeconfig")
    log = local.logs / "chart-operator.log"
    with operators_paused(local), chart_operator(cluster, docs, kubeconfig, log):
        obj = run_job_to_success(cluster, namespace, "via-chart")
        assert obj["status"]["plan"]["pool"] == "l40s"
        # The pools' capacity was written by the same operator.
        pool = wait_for(
            "pool capacity",
            lambda: (cluster.get("gpupool", "l40s") or {}).get("status", {}).get("nodes"),
            30,
        )
        assert pool == 4
        answered, url = helm_test_check(cluster, release, kubeconfig)
        assert answered.returncode == 0, answered.stdout + answered.stderr
        assert answered.stdout.splitlines() == [
            "ok   CRD finetunejobs.kubetune.io is established",
            "ok   CRD gpupools.kubetune.io is established",
            f"ok   the operator answers at {url} (version 0.1.0)",
        ]
    assert not forbidden_lines(log), "\n".join(forbidden_lines(log)[-20:])
    # With the operator gone, the check says so, and fails.
    gone, url = helm_test_check(cluster, release, kubeconfig)
    assert gone.returncode == 1
    assert f"FAIL the operator does not answer at {url}" in gone.stdout


def helm_test_check(
    cluster: Cluster, release: str, kubeconfig: Path
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the chart's `helm test` pod's command here, as the chart's ServiceAccount, with
    the metrics Service's URL pointed at the local operator's metrics port (the pod would
    reach the Service)."""
    text = helm(cluster.local, "get", "hooks", release, "-n", RELEASE_NS).stdout
    (pod,) = [d for d in yaml.safe_load_all(text) if d and d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["kubetune"]
    port = yaml.safe_load(helm(cluster.local, "get", "values", release, "-n", RELEASE_NS).stdout)[
        "metrics"
    ]["port"]
    url = f"http://127.0.0.1:{port}/metrics"
    args = [
        f"--operator-url={url}" if a.startswith("--operator-url=") else a for a in container["args"]
    ]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    done = subprocess.run(
        [sys.executable, "-m", "kubetune.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    return done, url


# ---------------------------------------------------------------------- pod security


def pod_from_template(deploy: dict[str, Any]) -> dict[str, Any]:
    template = deploy["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{deploy['metadata']['name']}-template"},
        "spec": template["spec"],
    }


def server_dry_run(cluster: Cluster, pod: dict[str, Any], namespace: str, *as_user: str) -> str:
    """Create `pod` with `--dry-run=server`, through every admission plugin (PodSecurity
    included) without keeping it; the error output, empty when it was admitted."""
    out = cluster.kubectl(
        "create",
        "--dry-run=server",
        "-n",
        namespace,
        "-f",
        "-",
        *as_user,
        input=yaml.safe_dump(pod),
        check=False,
    )
    return "" if out.returncode == 0 else out.stderr.strip()


def test_chart_pods_pass_the_restricted_pod_security_standard(
    cluster: Cluster, release: str
) -> None:
    """The operator's pod and the `helm test` pod are admitted where `restricted` is enforced
    (hack/kind-e2e.sh runs both there); a pod without the chart's securityContext is not,
    so the API server does enforce it."""
    labels = cluster.get("namespace", RELEASE_NS)["metadata"]["labels"]  # type: ignore[index]
    assert labels[ENFORCE] == "restricted"
    (deploy,) = [d for d in manifest(cluster.local, release) if d["kind"] == "Deployment"]
    hooks = helm(cluster.local, "get", "hooks", release, "-n", RELEASE_NS).stdout
    (check,) = [d for d in yaml.safe_load_all(hooks) if d and d["kind"] == "Pod"]
    operator_pod = pod_from_template(deploy)
    for pod in (operator_pod, check):
        assert server_dry_run(cluster, pod, RELEASE_NS) == "", pod["metadata"]["name"]
    bare = pod_from_template(deploy)
    bare["spec"] = {k: v for k, v in bare["spec"].items() if k != "securityContext"}
    bare["spec"]["containers"] = [
        {k: v for k, v in c.items() if k != "securityContext"} for c in bare["spec"]["containers"]
    ]
    refused = server_dry_run(cluster, bare, RELEASE_NS)
    assert REFUSED in refused, refused


# ---------------------------------------------------------------------- tenant roles

TENANT_GROUP = "ml-team"


def as_user(user: str) -> tuple[str, ...]:
    """kubectl impersonating a signed-in user of a team (the API server adds
    system:authenticated to an impersonated user's groups, as to a real one's)."""
    return (f"--as={user}", f"--as-group={TENANT_GROUP}")


def user_can_i(cluster: Cluster, user: str, *args: str) -> str:
    out = cluster.kubectl("auth", "can-i", *args, *as_user(user), check=False)
    return out.stdout.strip()


def tenant_answers(cluster: Cluster, user: str, namespace: str) -> dict[str, str]:
    ftj, pools = "finetunejobs.kubetune.io", "gpupools.kubetune.io"
    checks = {
        f"create {ftj} -n NS": ("create", ftj, "-n", namespace),
        f"get {ftj} -n NS": ("get", ftj, "-n", namespace),
        f"list {ftj} -n NS": ("list", ftj, "-n", namespace),
        f"watch {ftj} -n NS": ("watch", ftj, "-n", namespace),
        f"update {ftj} -n NS": ("update", ftj, "-n", namespace),
        f"patch {ftj} -n NS": ("patch", ftj, "-n", namespace),
        f"delete {ftj} -n NS": ("delete", ftj, "-n", namespace),
        f"get {ftj}/status -n NS": ("get", ftj, "--subresource=status", "-n", namespace),
        f"patch {ftj}/status -n NS": ("patch", ftj, "--subresource=status", "-n", namespace),
        f"create {ftj} -n default": ("create", ftj, "-n", "default"),
        f"delete {ftj} -n default": ("delete", ftj, "-n", "default"),
        f"list {ftj} -A": ("list", ftj, "-A"),
        f"get {pools}": ("get", pools),
        f"list {pools}": ("list", pools),
        f"watch {pools}": ("watch", pools),
        f"create {pools}": ("create", pools),
        f"patch {pools}": ("patch", pools),
        f"delete {pools}": ("delete", pools),
        f"patch {pools}/status": ("patch", pools, "--subresource=status"),
    }
    return {what: user_can_i(cluster, user, *args) for what, args in checks.items()}


YES_EDIT = {
    *(f"{v} finetunejobs.kubetune.io -n NS" for v in ("create", "get", "list", "watch")),
    *(f"{v} finetunejobs.kubetune.io -n NS" for v in ("update", "patch", "delete")),
    "get finetunejobs.kubetune.io/status -n NS",
    "get gpupools.kubetune.io",
    "list gpupools.kubetune.io",
    "watch gpupools.kubetune.io",
}
YES_VIEW = {
    *(f"{v} finetunejobs.kubetune.io -n NS" for v in ("get", "list", "watch")),
    "get finetunejobs.kubetune.io/status -n NS",
    "get gpupools.kubetune.io",
    "list gpupools.kubetune.io",
    "watch gpupools.kubetune.io",
}
YES_NO_BINDING = {
    "get gpupools.kubetune.io",
    "list gpupools.kubetune.io",
    "watch gpupools.kubetune.io",
}


def test_tenant_roles_give_namespace_users_jobs_there_and_pools_to_read(
    cluster: Cluster, namespace: str, release: str
) -> None:
    """`edit` or `view` bound in one namespace (a RoleBinding, as a cluster admin hands out
    namespaces): jobs there and nowhere else, every pool to read, no pool or job status to
    write. A user without any binding still reads pools (the pool-reader binding)."""
    cluster.kubectl(
        "create", "rolebinding", "alice-edit", "--clusterrole=edit", "--user=alice", "-n", namespace
    )
    cluster.kubectl(
        "create", "rolebinding", "bob-view", "--clusterrole=view", "--user=bob", "-n", namespace
    )
    # The aggregation controller adds the chart's rules to edit and view.
    wait_for(
        "edit and view to aggregate the tenant rules",
        lambda: (
            user_can_i(cluster, "alice", "create", "finetunejobs.kubetune.io", "-n", namespace)
            == "yes"
            and user_can_i(cluster, "bob", "list", "finetunejobs.kubetune.io", "-n", namespace)
            == "yes"
        ),
        30,
    )
    for user, yes in (("alice", YES_EDIT), ("bob", YES_VIEW), ("carol", YES_NO_BINDING)):
        answers = tenant_answers(cluster, user, namespace)
        expected = {what: "yes" if what in yes else "no" for what in answers}
        assert answers == expected, user
    # What a refused user sees.
    job = yaml.safe_dump(job_doc("elsewhere"))
    out = cluster.kubectl(
        "create", "-n", "default", "-f", "-", *as_user("alice"), input=job, check=False
    )
    assert out.returncode != 0
    assert (
        'User "alice" cannot create resource "finetunejobs" in API group "kubetune.io" in the '
        'namespace "default"'
    ) in out.stderr, out.stderr
    pool = {"apiVersion": "kubetune.io/v1alpha1", "kind": "GPUPool", **CHART_POOL}
    pool["metadata"] = {"name": pool.pop("name")}
    out = cluster.kubectl(
        "create", "-f", "-", *as_user("alice"), input=yaml.safe_dump(pool), check=False
    )
    assert out.returncode != 0
    assert (
        'User "alice" cannot create resource "gpupools" in API group "kubetune.io" at the '
        "cluster scope"
    ) in out.stderr, out.stderr
    listed = cluster.kubectl("get", "gpupools", "-o", "name", *as_user("carol"))
    assert f"gpupool.kubetune.io/{CHART_POOL['name']}" in listed.stdout.split()


def test_tenant_runs_a_job_to_success_in_a_restricted_namespace(
    cluster: Cluster, namespace: str, release: str, tmp_path: Path
) -> None:
    """A user with `edit` in the namespace applies, follows and deletes a job; the operator
    runs with only the chart's RBAC; the namespace enforces the `restricted` Pod Security
    Standard, and the trainer pods were admitted there."""
    labels = cluster.get("namespace", namespace)["metadata"]["labels"]  # type: ignore[index]
    assert {k: labels.get(k) for k in RESTRICTED_LABELS} == RESTRICTED_LABELS
    cluster.kubectl(
        "create", "rolebinding", "alice-edit", "--clusterrole=edit", "--user=alice", "-n", namespace
    )
    alice = as_user("alice")
    wait_for(
        "edit to aggregate the tenant rules",
        lambda: (
            user_can_i(cluster, "alice", "create", "finetunejobs.kubetune.io", "-n", namespace)
            == "yes"
        ),
        30,
    )
    local = cluster.local
    sa = f"{release}-kubetune"
    docs = manifest(local, release)
    kubeconfig = service_account_kubeconfig(cluster, sa, tmp_path / "sa.kubeconfig")
    log = local.logs / "chart-operator-tenant.log"
    name = "by-tenant"
    with operators_paused(local), chart_operator(cluster, docs, kubeconfig, log):
        job = yaml.safe_dump(job_doc(name, resources={"pools": ["l40s"]}))
        cluster.kubectl("create", "-n", namespace, "-f", "-", *alice, input=job)

        def phase() -> str:
            out = cluster.kubectl(
                "get", "ftj", name, "-n", namespace, "-o", "jsonpath={.status.phase}", *alice
            )
            return out.stdout if out.stdout in ("Succeeded", "Failed") else ""

        assert wait_for(f"{name} to finish", phase, 120) == "Succeeded"
        batch = cluster.get("job.batch", f"{name}-a1", namespace)
        assert batch is not None
        assert batch["spec"]["template"]["spec"]["containers"][0]["image"] == TRAINER_IMAGE
        events = cluster.list("events", namespace)
        reasons = {
            e["reason"]
            for e in events
            if e["involvedObject"]["kind"] == "Job"
            and e["involvedObject"]["name"] == batch["metadata"]["name"]
        }
        # The Job controller's pods passed PodSecurity admission (a refused pod is a
        # FailedCreate Event of the Job, with the violations in its message).
        assert "SuccessfulCreate" in reasons and "FailedCreate" not in reasons, reasons
        # A pod of the same template without its securityContext would not have been.
        template = batch["spec"]["template"]
        bare = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "trainer-without-security-context"},
            "spec": {
                **{k: v for k, v in template["spec"].items() if k != "securityContext"},
                "containers": [
                    {k: v for k, v in c.items() if k != "securityContext"}
                    for c in template["spec"]["containers"]
                ],
            },
        }
        refused = server_dry_run(cluster, bare, namespace)
        assert REFUSED in refused, refused
        cluster.kubectl(
            "delete", "ftj", name, "-n", namespace, "--wait=true", "--timeout=60s", *alice
        )
    assert not forbidden_lines(log), "\n".join(forbidden_lines(log)[-20:])


# ---------------------------------------------------------------------- namespaced mode


def test_namespaced_mode_runs_with_roles_in_watched_namespaces(
    cluster: Cluster, namespace: str, release: str, tmp_path: Path
) -> None:
    """A second release watching one namespace: Roles there, a ClusterRole for the rest."""
    local = cluster.local
    name = "ktns"
    values = {**base_values(), "watch": {"namespaces": [namespace]}, "crds": {"install": False}}
    install(local, name, values, tmp_path)
    try:
        sa = f"{name}-kubetune"
        role = cluster.get("role", sa, namespace)
        assert role is not None
        assert cluster.get("clusterrole", f"{sa}-cluster") is not None
        assert can_i(cluster, sa, "create", "jobs.batch", "-n", namespace)
        assert not can_i(cluster, sa, "create", "jobs.batch", "-n", "default")
        assert not can_i(cluster, sa, "list", "finetunejobs.kubetune.io", "-n", "default")
        docs = manifest(local, name)
        kubeconfig = service_account_kubeconfig(cluster, sa, tmp_path / "sa.kubeconfig")
        log = local.logs / "chart-operator-namespaced.log"
        with operators_paused(local), chart_operator(cluster, docs, kubeconfig, log):
            run_job_to_success(cluster, namespace, "via-role")
        assert not forbidden_lines(log), "\n".join(forbidden_lines(log)[-20:])
    finally:
        helm(local, "uninstall", name, "-n", RELEASE_NS, "--wait", check=False)


# ---------------------------------------------------------------------- leader election


def lease_holder(cluster: Cluster, name: str) -> str:
    lease = cluster.get("lease", name, RELEASE_NS)
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


def test_replicas_elect_a_leader_with_only_the_chart_rbac(
    cluster: Cluster, namespace: str, release: str, tmp_path: Path
) -> None:
    """replicaCount 2: both replicas run as the chart's ServiceAccount, one leads."""
    local = cluster.local
    name = "ktha"
    sa = lease = f"{name}-kubetune"
    values = {
        **base_values(),
        "replicaCount": 2,
        "leaderElection": {
            "leaseDurationSeconds": 6,
            "renewDeadlineSeconds": 4,
            "retryPeriodSeconds": 1,
        },
        "watch": {"namespaces": [namespace]},
        "crds": {"install": False},
    }
    install(local, name, values, tmp_path)
    try:
        leases = "leases.coordination.k8s.io"
        assert can_i(cluster, sa, "create", leases, "-n", RELEASE_NS)
        assert can_i(cluster, sa, "update", f"{leases}/{lease}", "-n", RELEASE_NS)
        assert not can_i(cluster, sa, "update", f"{leases}/another", "-n", RELEASE_NS)
        assert not can_i(cluster, sa, "delete", f"{leases}/{lease}", "-n", RELEASE_NS)
        assert not can_i(cluster, sa, "create", leases, "-n", namespace)
        docs = manifest(local, name)
        kubeconfig = service_account_kubeconfig(cluster, sa, tmp_path / "sa.kubeconfig")
        logs = [local.logs / f"chart-replica-{i}.log" for i in range(2)]
        with (
            operators_paused(local),
            chart_operator(cluster, docs, kubeconfig, logs[0], pod=f"{name}-0") as first,
        ):
            wait_for(
                "replica 0 to lead",
                lambda: lease_holder(cluster, lease).startswith(f"{name}-0_"),
                30,
            )
            with chart_operator(cluster, docs, kubeconfig, logs[1], pod=f"{name}-1"):
                wait_for("replica 1 to stand by", lambda: "standing by" in logs[1].read_text(), 30)
                run_job_to_success(cluster, namespace, "via-leader")
                first.terminate()  # SIGTERM, as a rolling update does: it releases the lease
                assert first.wait(timeout=30) == 0, logs[0].read_text()[-3000:]
                wait_for(
                    "replica 1 to take over",
                    lambda: lease_holder(cluster, lease).startswith(f"{name}-1_"),
                    15,
                )
                run_job_to_success(cluster, namespace, "via-new-leader")
        for log in logs:
            assert not forbidden_lines(log), "\n".join(forbidden_lines(log)[-20:])
    finally:
        helm(local, "uninstall", name, "-n", RELEASE_NS, "--wait", check=False)
        cluster.kubectl(
            "delete", "lease", lease, "-n", RELEASE_NS, "--ignore-not-found", check=False
        )


def test_upgrade_then_uninstall_keeps_the_crds(
    cluster: Cluster, release: str, tmp_path: Path
) -> None:
    """Runs last: `helm upgrade` re-applies the CRD templates and the pools from values in
    place (same objects, status kept); uninstall keeps them."""
    local = cluster.local
    uid = cluster.get("crd", "finetunejobs.kubetune.io")["metadata"]["uid"]  # type: ignore[index]
    pool_name = CHART_POOL["name"]
    with operators_paused(local):  # nothing else writes the pool's status meanwhile
        cluster.kubectl(
            "patch",
            "gpupool",
            pool_name,
            "--subresource=status",
            "--type=merge",
            "-p",
            '{"status": {"updatedAt": "2026-11-24T00:00:00Z", "nodes": 3}}',
        )
        pool = cluster.get("gpupool", pool_name)
        assert pool is not None
        helm(
            local,
            "upgrade",
            release,
            str(CHART),
            "-n",
            RELEASE_NS,
            "--reuse-values",
            "--set-json",
            "operator.safetyFactor=1.3",
        )
        upgraded = cluster.get("gpupool", pool_name)
    # Deleted and created again, a pool would lose its status and its UID (and jobs
    # planned on it would see it vanish): the upgrade patches it in place.
    assert upgraded is not None
    assert upgraded["metadata"]["uid"] == pool["metadata"]["uid"]
    assert upgraded["status"]["updatedAt"] == "2026-11-24T00:00:00Z"
    assert upgraded["status"]["nodes"] == 3
    assert upgraded["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "helm.sh/hook" not in upgraded["metadata"]["annotations"]
    deploy = cluster.get("deployment", f"{release}-kubetune", RELEASE_NS)
    assert deploy is not None
    env = {
        e["name"]: e.get("value")
        for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["KUBETUNE_SAFETY_FACTOR"] == "1.3"
    crd = cluster.get("crd", "finetunejobs.kubetune.io")
    assert crd is not None and crd["metadata"]["uid"] == uid
    helm(local, "uninstall", release, "-n", RELEASE_NS, "--wait")
    assert cluster.get("clusterrole", f"{release}-kubetune") is None
    for name in ("finetunejobs.kubetune.io", "gpupools.kubetune.io"):
        crd = cluster.get("crd", name)
        assert crd is not None and crd["metadata"]["uid"], f"{name} was removed"
    assert cluster.get("gpupool", "l40s") is not None


def test_pools_of_a_first_install_without_the_crds_are_adopted_by_the_next_upgrade(
    binaries: Binaries, tmp_path: Path
) -> None:
    """A cluster that has never seen kubetune: the release creates the GPUPool CRD, so its
    pools come from a post-install hook; the next upgrade adopts them as release objects
    (same UID, status kept) and later upgrades patch them in place.

    A control plane of its own (about 10 s to start): the session's has the CRDs."""
    fresh = LocalCluster(tmp_path / "fresh", binaries, die_with_caller=True)
    fresh.start()
    try:
        kube = Cluster(fresh)
        values = tmp_path / "values.yaml"
        values.write_text(yaml.safe_dump({**base_values(), "gpuPools": [CHART_POOL]}))
        name = CHART_POOL["name"]

        def pool() -> dict[str, Any]:
            obj = kube.get("gpupool", name)
            assert obj is not None, f"GPUPool {name} is gone"
            return obj

        helm(
            fresh,
            "install",
            "kt",
            str(CHART),
            "-n",
            RELEASE_NS,
            "--create-namespace",
            "-f",
            str(values),
        )
        installed = pool()
        assert installed["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
        kube.kubectl(
            "patch",
            "gpupool",
            name,
            "--subresource=status",
            "--type=merge",
            "-p",
            '{"status": {"nodes": 3}}',
        )
        for factor in ("1.3", "1.4"):
            helm(
                fresh,
                "upgrade",
                "kt",
                str(CHART),
                "-n",
                RELEASE_NS,
                "--reuse-values",
                "--set-json",
                f"operator.safetyFactor={factor}",
            )
            upgraded = pool()
            assert upgraded["metadata"]["uid"] == installed["metadata"]["uid"]
            assert upgraded["status"]["nodes"] == 3
            assert "helm.sh/hook" not in upgraded["metadata"]["annotations"]
        assert name in {
            d["metadata"]["name"] for d in manifest(fresh, "kt") if d["kind"] == "GPUPool"
        }
        helm(fresh, "uninstall", "kt", "-n", RELEASE_NS, "--wait")
        assert pool()["metadata"]["uid"] == installed["metadata"]["uid"]
    finally:
        fresh.stop()
