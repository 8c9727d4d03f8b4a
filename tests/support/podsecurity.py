"""Pod Security Standards for the namespaces tests run jobs in.

The integration and e2e tiers (local and kind) create the namespaces their FineTuneJobs run
in with the `restricted` standard enforced, as a careful cluster admin would: the API
server's PodSecurity admission then refuses any pod there (a trainer pod, a data-prep or
volume-reader pod of a test) that is not restricted-compliant, so a trainer pod that drifts
from the standard fails the tests instead of a user's install.
"""

from __future__ import annotations

from typing import Any

ENFORCE = "pod-security.kubernetes.io/enforce"
RESTRICTED_LABELS = {ENFORCE: "restricted"}
"""The labels of a namespace that enforces the `restricted` Pod Security Standard."""

RESTRICTED_CONTAINER: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""A container securityContext the `restricted` standard admits on its own (no pod-level
settings needed): the securityContext of every helper pod a test creates in such a namespace."""

REFUSED = 'violates PodSecurity "restricted:latest"'
"""What the API server answers for a pod the standard refuses."""


def restricted_namespace(name: str) -> dict[str, Any]:
    """A Namespace that enforces the `restricted` Pod Security Standard."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": dict(RESTRICTED_LABELS)},
    }


RESTRICTED_VOLUME_SOURCES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
"""The volume types the `restricted` standard allows."""


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What the `restricted` Pod Security Standard (latest) refuses in a pod spec, checked
    without an API server: the unit tier's guard for the builders; the integration tier has
    the API server's own PodSecurity admission do it."""
    found: list[str] = []
    ctx = pod.get("securityContext") or {}
    containers = [
        *pod.get("initContainers", []),
        *pod.get("containers", []),
        *pod.get("ephemeralContainers", []),
    ]
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(f"{key}=true")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_SOURCES:
            found.append(f"volume {volume['name']} of type {sorted(kinds)}")
    if ctx.get("runAsUser") == 0:
        found.append("pod runAsUser=0")
    for c in containers:
        name = c["name"]
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            found.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation != false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            found.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds capabilities {caps['add']}")
        if sc.get("runAsNonRoot", ctx.get("runAsNonRoot")) is not True:
            found.append(f"{name}: runAsNonRoot != true")
        if sc.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser=0")
        seccomp = (sc.get("seccompProfile") or ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"{name}: hostPort")
    return found
