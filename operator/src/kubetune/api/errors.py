"""Domain errors. Only the handlers translate these into kopf's retry/stop errors.

Every error carries a human message that says what is wrong and, where the user can act,
a "To fix:" line. `permanent` tells the handlers whether retrying could help.
"""

from __future__ import annotations


class KubetuneError(Exception):
    """Base class; `permanent` errors are not retried."""

    permanent: bool = True

    def __init__(self, message: str, to_fix: str | None = None) -> None:
        self.message = message
        self.to_fix = to_fix
        super().__init__(self.__str__())

    def __str__(self) -> str:
        if self.to_fix:
            return f"{self.message}\nTo fix: {self.to_fix}"
        return self.message


class SpecError(KubetuneError):
    """The FineTuneJob spec is invalid in a way the CRD schema cannot express."""


class InfeasibleError(KubetuneError):
    """No pool, GPU count and method can run the job within its limits."""


class TransientError(KubetuneError):
    """Something outside the job is not ready yet (no pools, apiserver hiccup); retry."""

    permanent = False
