"""The stage-in's progress over all its sources, as the `STAGE_IN_METRICS` gauges.

The values are computed when the endpoint is scraped, from the `Progress` of each source
fetched (finished files, plus the bytes of files still arriving) and what was found in the
cache (counted as done). A source's totals are added once it is listed (the dataset before
the model, a hub model's weights once its index is in), so a total is 0 until the first
listing and grows while the sources become known.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kubetune_trainer.contract import STAGE_IN_METRICS
from kubetune_trainer.metrics import ADDR_ENV, DEFAULT_ADDR
from kubetune_trainer.stagein.fetch import Progress

log = logging.getLogger(__name__)

HELP = {
    "bytes_done": "Bytes of the model and dataset fetched or found in the cache",
    "bytes_total": "Bytes of the model and dataset to stage (0 until known)",
    "files_done": "Files of the model and dataset fetched or found in the cache",
    "files_total": "Files of the model and dataset to stage (0 until known)",
}


class StageProgress(Collector):
    """Every source of one stage-in: its fetches' `Progress` and its cache hits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: list[Progress] = []
        self._found_files = 0
        self._found_bytes = 0
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.port: int | None = None
        self._server: Any = None

    def source(self, what: str, uri: str) -> Progress:
        """The `Progress` a fetch of `uri` reports to."""
        progress = Progress(what, uri)
        with self._lock:
            self._sources.append(progress)
        return progress

    def found(self, files: int, nbytes: int) -> None:
        """A source found whole in the cache: done as soon as it is known."""
        with self._lock:
            self._found_files += files
            self._found_bytes += nbytes

    def values(self) -> dict[str, int]:
        """The gauges' values now, by `STAGE_IN_METRICS` name."""
        with self._lock:
            sources = list(self._sources)
            out = {
                "bytes_done": self._found_bytes,
                "bytes_total": self._found_bytes,
                "files_done": self._found_files,
                "files_total": self._found_files,
            }
        for progress in sources:
            files_done, files_total, bytes_done, bytes_total = progress.counts()
            out["files_done"] += files_done
            out["files_total"] += files_total
            out["bytes_done"] += bytes_done
            out["bytes_total"] += bytes_total
        return out

    def collect(self) -> Iterator[Metric]:
        for name, value in self.values().items():
            gauge = GaugeMetricFamily(STAGE_IN_METRICS[name], HELP[name])
            gauge.add_metric([], value)
            yield gauge

    def describe(self) -> Iterator[Metric]:
        return iter(())  # computed at scrape time: nothing to check at registration

    def serve(self, port: int) -> None:
        """Serve the gauges on `port` (0: any free one, then `self.port`) until `close`."""
        addr = os.environ.get(ADDR_ENV, DEFAULT_ADDR)
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        self.port = int(server.server_port)
        log.info("stage-in progress on %s:%d/metrics", addr, self.port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
