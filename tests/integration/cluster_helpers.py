"""Helpers for integration tests: kubectl wrappers and polling."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from typing import Any

import yaml

from kubetune_dev.cluster import LocalCluster


class Cluster:
    """Test-facing helpers around a running LocalCluster."""

    def __init__(self, local: LocalCluster) -> None:
        self.local = local

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.local.kubectl(*args, input=input, check=check)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind, name, "-o", "json"]
        if namespace:
            args += ["-n", namespace]
        out = self.kubectl(*args, check=False)
        if out.returncode != 0:
            if "NotFound" in out.stderr:
                return None
            raise AssertionError(out.stderr)
        return dict(json.loads(out.stdout))

    def list(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[dict[str, Any]]:
        args = ["get", kind, "-o", "json"]
        args += ["-n", namespace] if namespace else ["-A"]
        if selector:
            args += ["-l", selector]
        return list(json.loads(self.kubectl(*args).stdout)["items"])

    def apply(
        self, *docs: dict[str, Any], namespace: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        text = "---\n".join(yaml.safe_dump(d) for d in docs)
        args = ["apply", "-f", "-"]
        if namespace:
            args += ["-n", namespace]
        return self.kubectl(*args, input=text, check=False)


def wait_for(
    what: str, probe: Callable[[], Any], timeout: float = 60.0, interval: float = 0.5
) -> Any:
    """Poll `probe` until it returns something truthy; fail with `what` on timeout."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
