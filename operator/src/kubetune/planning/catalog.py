"""The built-in GPUPool catalog: common cloud GPUs with list prices (pure data).

`kubetune plan` plans against it when no `--pools` file is given, and the local control plane
simulates some of its pools. It is `data/gpupools.yaml`, the same text as
`examples/gpupools.yaml` (a unit test keeps the two equal), shipped inside the package so
that planning works offline.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml

from kubetune.api.v1alpha1 import GPUPool

CATALOG_FILE = "data/gpupools.yaml"


@cache
def _catalog_text() -> str:
    return resources.files(__package__ or "kubetune.planning").joinpath(CATALOG_FILE).read_text()


def default_pools() -> list[GPUPool]:
    """A fresh copy of every pool in the built-in catalog."""
    return [GPUPool.model_validate(doc) for doc in yaml.safe_load_all(_catalog_text()) if doc]
