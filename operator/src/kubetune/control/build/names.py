"""Names, labels and owner references of a FineTuneJob's children.

Names are deterministic so that re-running a handler finds what an earlier run created.
An *attempt* is one launch of the batch Job: it starts at 1 and increases on every
relaunch (after a failure, after an out-of-memory re-plan, on resume after suspend), so a
new attempt never collides with a Job that is still terminating.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from kubetune.api.v1alpha1 import API_VERSION, FineTuneJob
from kubetune.api.vocabulary import (
    LABEL_ATTEMPT,
    LABEL_INSTANCE,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    StepKind,
)

# Budget for the shared part of every child name. The longest name derived from it is the
# pod hostname of an Indexed Job, `<base>-a<attempt>-<index>`, which must be a DNS label
# (≤ 63): this leaves room for five attempt digits and four index digits.
_MAX_BASE = 63 - len("-a99999") - len("-9999")
_HASH_LEN = 6
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class ChildNames:
    pvc: str
    config_map: str
    service: str
    network_policy: str
    job: str


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_LEN]


def dns_label(text: str, max_len: int) -> str:
    """`text` when it is a DNS-1035 label (letter first) of at most `max_len` characters.

    Anything else (too long, dots, a leading digit) is cleaned, cut, and gets a hash of the
    original appended, which keeps the result stable and keeps `a.b` and `a-b` apart.
    """
    cleaned = re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"ftj-{cleaned}".rstrip("-")
    if cleaned == text and len(cleaned) <= max_len:
        return cleaned
    head = cleaned[: max_len - _HASH_LEN - 1].rstrip("-")
    return f"{head}-{_short_hash(text)}"


def _base_name(job_name: str) -> str:
    # FineTuneJob names are DNS subdomains (up to 253 characters, dots, a digit may come
    # first); Service names and pod hostnames must be DNS labels.
    if not job_name:
        raise ValueError("the FineTuneJob has no metadata.name")
    return dns_label(job_name, _MAX_BASE)


def label_value(name: str) -> str:
    # Object names are valid label values up to 63 characters; longer ones are shortened
    # the same way as child names.
    return name if len(name) <= 63 else _base_name(name)


def child_names(job_name: str, attempt: int) -> ChildNames:
    """Names of the children of one FineTuneJob for one attempt (deterministic)."""
    if attempt < 1:
        raise ValueError(f"attempt must be 1 or more, got {attempt}")
    base = _base_name(job_name)
    names = ChildNames(
        pvc=f"{base}-ckpt",
        config_map=f"{base}-a{attempt}",
        service=base,
        network_policy=base,
        job=f"{base}-a{attempt}",
    )
    for name in (names.pvc, names.config_map, names.service, names.network_policy, names.job):
        if len(name) > 63 or not _DNS_LABEL.match(name):
            raise ValueError(f"child name {name!r} of {job_name!r} is not a DNS label")
    return names


def step_name(job_name: str, kind: StepKind) -> str:
    """Name of a step's Job and ConfigMap: `<job>-stagein`, `<job>-stageout`."""
    return f"{_base_name(job_name)}-{kind.value.replace('-', '')}"


def stage_in_name(job_name: str) -> str:
    return step_name(job_name, StepKind.STAGE_IN)


def metadata(job: FineTuneJob) -> tuple[str, str, str]:
    """The job's name, namespace (`default` when unset) and uid."""
    name = str(job.metadata.get("name") or "")
    if not name:
        raise ValueError("the FineTuneJob has no metadata.name")
    namespace = str(job.metadata.get("namespace") or "default")
    uid = str(job.metadata.get("uid") or "")
    return name, namespace, uid


def owner_reference(job: FineTuneJob) -> dict[str, Any]:
    """The controller reference that lets garbage collection delete a child with its job."""
    name, _, uid = metadata(job)
    return {
        "apiVersion": API_VERSION,
        "kind": job.kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(job: FineTuneJob, attempt: int | None = None) -> dict[str, str]:
    name, _, _ = metadata(job)
    value = label_value(name)
    result = {
        LABEL_NAME: "kubetune-trainer",
        LABEL_MANAGED_BY: "kubetune",
        LABEL_INSTANCE: value,
        LABEL_JOB: value,
    }
    if attempt is not None:
        result[LABEL_ATTEMPT] = str(attempt)
    return result


def object_meta(
    job: FineTuneJob,
    name: str,
    *,
    attempt: int | None = None,
    owned: bool = True,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    _, namespace, _ = metadata(job)
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": labels(job, attempt),
    }
    if annotations:
        meta["annotations"] = annotations
    if owned:
        meta["ownerReferences"] = [owner_reference(job)]
    return meta
