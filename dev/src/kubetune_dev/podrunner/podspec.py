"""What a pod's spec says, worked out without touching the machine: pure functions only.

Resource quantities, `$(VAR)` expansion, the downward API's field and resource references, a
container's environment (in the kubelet's order) and argv, the pod's hostname and the text of
its /etc/hosts. What they need from the API server comes through `Lookup`, so that unit tests
can hand them a dict; what cannot be resolved yet raises `NotReady`, which the runner retries.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol

CLUSTER_DOMAIN = "cluster.local"
DEFAULT_HOST_IP = "127.0.0.1"


class NotReady(Exception):
    """The pod cannot start yet (missing ConfigMap, unbound claim, ...); retried every second."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class PodFacts:
    """What the downward API knows of a pod besides its object: where it runs."""

    pod_ip: str
    host_ip: str = DEFAULT_HOST_IP
    node_name: str = ""
    allocatable: Mapping[str, str] = field(default_factory=dict)
    """Node allocatable: the default of a limit the container does not set."""


class Lookup(Protocol):
    """What resolving env and volumes needs from the API (a dict-backed fake in unit tests)."""

    def config_map(self, namespace: str, name: str) -> dict[str, bytes] | None: ...

    def secret(self, namespace: str, name: str) -> dict[str, bytes] | None: ...

    def claim_path(self, namespace: str, claim: str) -> str: ...

    def token(self, pod: Mapping[str, Any], audience: str | None, expiration: int) -> str: ...


_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(.*)$")
_SUFFIXES: dict[str, Decimal] = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}


def parse_quantity(text: str | int | float) -> Decimal:
    """A Kubernetes resource quantity (`500m`, `16Gi`, `1e3`, `2`) as a number."""
    raw = str(text).strip()
    match = _QUANTITY.match(raw)
    if match is None:
        raise ValueError(f"not a quantity: {text!r}")
    number, suffix = match.groups()
    try:
        value = Decimal(number)
        if suffix in _SUFFIXES:
            return value * _SUFFIXES[suffix]
        if suffix[:1] in ("e", "E"):
            return value * (Decimal(10) ** int(suffix[1:]))
    except (InvalidOperation, ValueError):
        pass
    raise ValueError(f"not a quantity: {text!r}")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known names are replaced, `$$` is a literal `$`,
    unknown references and anything else are left as written."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:
                out.append("$(")
                i += 2
            else:
                name = text[i + 2 : end]
                out.append(env.get(name, f"$({name})"))
                i = end + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


_SUBSCRIPT = re.compile(r"""^metadata\.(labels|annotations)\[['"](.+)['"]\]$""")


def _format_map(values: Mapping[str, str]) -> str:
    return "\n".join(f"{k}={json.dumps(v)}" for k, v in sorted(values.items()))


def field_value(pod: Mapping[str, Any], path: str, facts: PodFacts) -> str:
    """The downward-API value of `fieldRef.fieldPath` for this pod."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    match = _SUBSCRIPT.match(path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    values: dict[str, str] = {
        "metadata.name": str(meta.get("name", "")),
        "metadata.namespace": str(meta.get("namespace", "")),
        "metadata.uid": str(meta.get("uid", "")),
        "metadata.labels": _format_map(meta.get("labels") or {}),
        "metadata.annotations": _format_map(meta.get("annotations") or {}),
        "spec.nodeName": str(spec.get("nodeName") or facts.node_name),
        "spec.serviceAccountName": str(spec.get("serviceAccountName") or "default"),
        "status.podIP": facts.pod_ip,
        "status.podIPs": facts.pod_ip,
        "status.hostIP": facts.host_ip,
        "status.hostIPs": facts.host_ip,
    }
    if path not in values:
        raise NotReady("CreateContainerConfigError", f"unsupported fieldPath {path!r}")
    return values[path]


def resource_value(
    container: Mapping[str, Any], ref: Mapping[str, Any], allocatable: Mapping[str, str]
) -> str:
    """`resourceFieldRef`: the container's request/limit divided by the divisor, rounded up.

    A limit the container does not set is the node's allocatable amount (as in Kubernetes);
    a request it does not set is its limit if any, else 0.
    """
    kind, _, name = str(ref.get("resource", "")).partition(".")
    if kind not in ("limits", "requests") or not name:
        raise NotReady(
            "CreateContainerConfigError", f"unsupported resource {ref.get('resource')!r}"
        )
    resources = container.get("resources") or {}
    quantity = (resources.get(kind) or {}).get(name)
    if quantity is None and kind == "requests":
        quantity = (resources.get("limits") or {}).get(name)
    if quantity is None:
        quantity = allocatable.get(name, "0") if kind == "limits" else "0"
    divisor = parse_quantity(ref.get("divisor") or "1")
    if divisor == 0:
        divisor = Decimal(1)
    return str(math.ceil(parse_quantity(quantity) / divisor))


def _decode(data: Mapping[str, bytes], key: str) -> str:
    return data[key].decode("utf-8", errors="replace")


def build_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    lookup: Lookup,
    facts: PodFacts,
) -> dict[str, str]:
    """The container's own environment, in the kubelet's order: envFrom, then env.

    Missing non-optional ConfigMaps/Secrets/keys raise NotReady (CreateContainerConfigError).
    """
    namespace = str((pod.get("metadata") or {}).get("namespace", "default"))
    env: dict[str, str] = {}

    def source(kind: str, ref: Mapping[str, Any]) -> dict[str, bytes] | None:
        name = str(ref.get("name", ""))
        data = (
            lookup.config_map(namespace, name)
            if kind == "configmap"
            else lookup.secret(namespace, name)
        )
        if data is None and not ref.get("optional"):
            raise NotReady("CreateContainerConfigError", f'{kind} "{name}" not found')
        return data

    for item in container.get("envFrom") or []:
        prefix = str(item.get("prefix") or "")
        if "configMapRef" in item:
            data = source("configmap", item["configMapRef"])
        elif "secretRef" in item:
            data = source("secret", item["secretRef"])
        else:
            continue
        for key in sorted(data or {}):
            if "=" not in key:
                env[prefix + key] = _decode(data or {}, key)

    for item in container.get("env") or []:
        name = str(item["name"])
        if "valueFrom" not in item:
            env[name] = expand(str(item.get("value") or ""), env)
            continue
        ref = item["valueFrom"]
        if "fieldRef" in ref:
            env[name] = field_value(pod, str(ref["fieldRef"]["fieldPath"]), facts)
        elif "resourceFieldRef" in ref:
            env[name] = resource_value(container, ref["resourceFieldRef"], facts.allocatable)
        elif "configMapKeyRef" in ref or "secretKeyRef" in ref:
            kind = "configmap" if "configMapKeyRef" in ref else "secret"
            key_ref = ref.get("configMapKeyRef") or ref.get("secretKeyRef") or {}
            data = source(kind, key_ref)
            key = str(key_ref.get("key", ""))
            if data is not None and key in data:
                env[name] = _decode(data, key)
            elif not key_ref.get("optional"):
                raise NotReady(
                    "CreateContainerConfigError",
                    f"couldn't find key {key} in {kind} {namespace}/{key_ref.get('name')}",
                )
        else:
            raise NotReady("CreateContainerConfigError", f"env {name}: unsupported valueFrom")
    return env


def container_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """command + args with `$(VAR)` expanded; images are not run, so a command is required."""
    command = [str(c) for c in container.get("command") or []]
    if not command:
        raise NotReady(
            "StartError",
            "the local pod runner runs spec.containers[].command and ignores images; "
            f"container {container.get('name')!r} has no command",
        )
    args = [str(a) for a in container.get("args") or []]
    return [expand(a, env) for a in command + args]


def pod_hostname(pod: Mapping[str, Any]) -> str:
    spec = pod.get("spec") or {}
    name = str(spec.get("hostname") or (pod.get("metadata") or {}).get("name", "pod"))
    return name[:63].rstrip("-.")


def hosts_file(
    pod: Mapping[str, Any],
    pod_ip: str,
    siblings: Mapping[str, str],
    domain: str = CLUSTER_DOMAIN,
) -> str:
    """The pod's /etc/hosts: the kubelet's managed file, plus `<hostname>.<subdomain>` names
    (and their FQDNs) of the sibling pods this runner runs (hostname → IP), standing in for the
    headless Service's DNS records."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    namespace = str(meta.get("namespace", "default"))
    hostname = pod_hostname(pod)
    subdomain = str(spec.get("subdomain") or "")
    lines = [
        "# Kubernetes-managed hosts file (kubetune local pod runner).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        "fe00::0\tip6-localnet",
        "fe00::0\tip6-mcastprefix",
        "fe00::1\tip6-allnodes",
        "fe00::2\tip6-allrouters",
    ]
    if subdomain:
        lines.append(
            f"{pod_ip}\t{hostname}.{subdomain}.{namespace}.svc.{domain}\t"
            f"{hostname}.{subdomain}\t{hostname}"
        )
        for other, ip in sorted(siblings.items()):
            if other != hostname:
                lines.append(
                    f"{ip}\t{other}.{subdomain}.{namespace}.svc.{domain}\t{other}.{subdomain}"
                )
    else:
        lines.append(f"{pod_ip}\t{hostname}")
    for alias in spec.get("hostAliases") or []:
        names = " ".join(alias.get("hostnames") or [])
        if names and alias.get("ip"):
            lines.append(f"# Entries added by HostAliases.\n{alias['ip']}\t{names}")
    return "\n".join(lines) + "\n"
