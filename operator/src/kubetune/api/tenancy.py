"""What a job's namespace allows it: the pools it may use and the Secrets it may reference.

A GPUPool names the namespaces that may use it (`spec.namespaceSelector`, matched against
the namespace's labels). A namespace's owner names the Secrets its FineTuneJobs may pass to
trainer pods with an annotation on the Namespace, `kubetune.io/allowed-secrets: a,b`: a
Secret becomes a job's token only with that consent. The consent lives on the Namespace,
not on the Secret, because the operator must be able to read it: RBAC cannot grant reading a
Secret's labels without its contents: the operator reads a Secret only once the namespace
consented to it, to check before a launch that it exists (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kubetune.api.v1alpha1 import LabelSelector
from kubetune.api.vocabulary import ALLOWED_SECRETS_ANNOTATION


@dataclass(frozen=True)
class Tenant:
    """A job's namespace as the operator sees it: its name, labels and the Secrets its
    owner allowed FineTuneJobs to reference."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()
    allowed_secrets: frozenset[str] = frozenset()

    @classmethod
    def of(cls, name: str, labels: Mapping[str, str], annotations: Mapping[str, str]) -> Tenant:
        raw = annotations.get(ALLOWED_SECRETS_ANNOTATION) or ""
        return cls(
            name=name,
            labels=tuple(sorted(labels.items())),
            allowed_secrets=frozenset(s.strip() for s in raw.split(",") if s.strip()),
        )

    def may_use(self, selector: LabelSelector | None) -> bool:
        """Whether a pool with this `spec.namespaceSelector` takes this namespace's jobs."""
        return selector is None or selector.matches(dict(self.labels))

    def allows_secret(self, secret: str) -> bool:
        """Whether the namespace's owner consented to jobs using `secret`."""
        return secret in self.allowed_secrets

    def secret_refusal(self, secret: str, field: str) -> str | None:
        """Why `secret` (named by the job's `field`) may not be used, or None when it may."""
        if self.allows_secret(secret):
            return None
        allowed = ", ".join(sorted(self.allowed_secrets)) or "none"
        return (
            f"{field} names Secret {secret!r}, which namespace {self.name} has not allowed "
            f"FineTuneJobs to use (allowed: {allowed}). To fix: a namespace admin runs "
            f"`kubectl annotate namespace {self.name} --overwrite "
            f"{ALLOWED_SECRETS_ANNOTATION}={','.join(sorted(self.allowed_secrets | {secret}))}`"
        )
