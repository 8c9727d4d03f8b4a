"""Run the operator: kopf with kubetune's handlers, alone or as the elected leader of several.

Without leader election (KUBETUNE_LEADER_ELECTION unset or false) this is `kopf run
--standalone` with kubetune's handlers: one replica, which must never run twice.

With leader election the process first waits for the Lease (`controller.leader`), serving a
minimal `/healthz` on the liveness endpoint meanwhile so that the kubelet does not restart a
healthy standby. Once it holds the Lease it closes that endpoint, starts kopf in the same
process and event loop (kopf's own `/healthz` takes the endpoint over), and keeps renewing the
Lease beside it. A renewal that fails past the renew deadline ends the process with
`leader.EXIT_LEASE_LOST` at once (see `controller.leader`); a clean stop (SIGTERM) stops kopf
first and then releases the Lease, so that a standby takes over within one retry period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import urllib.parse
from collections.abc import Sequence

import kopf
from aiohttp import web
from lightkube import AsyncClient

import kubetune.controller.handlers  # noqa: F401  (registers kubetune's handlers with kopf)
from kubetune.controller import leader

log = logging.getLogger("kubetune.run")

LOG_LEVELS = ("quiet", "normal", "verbose", "debug")
LOG_FORMATS = ("plain", "full", "json")


def configure_logging(log_format: str = "full", log_level: str = "normal") -> None:
    """The same logging as `kopf run --log-format=... [--quiet|--verbose|--debug]`."""
    kopf.configure(
        debug=log_level == "debug",
        verbose=log_level == "verbose",
        quiet=log_level == "quiet",
        log_format=kopf.LogFormat[log_format.upper()],
    )


def run_operator(namespaces: Sequence[str], liveness: str, settings: leader.LeaderSettings) -> int:
    """Run until stopped; the process's exit status."""
    if not settings.enabled:
        kopf.run(
            standalone=True,
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            liveness_endpoint=liveness,
        )
        return 0
    return asyncio.run(run_elected(namespaces, liveness, settings))


async def run_elected(
    namespaces: Sequence[str], liveness: str, settings: leader.LeaderSettings
) -> int:
    """Wait for the Lease, then run kopf while renewing it; release it on a clean stop."""
    elector = leader.LeaseElector(AsyncClient(), settings)
    leader.install(elector)
    stop = asyncio.Event()
    _stop_on_signals(stop)
    health = await serve_standby_health(liveness, elector)
    try:
        acquired = await elector.acquire(stop)
    finally:
        await health.cleanup()
    if not acquired:
        log.info("stopped while standing by")
        await elector.client.close()
        return 0
    # Created before kopf starts, so kopf's shutdown leaves it alone: the Lease is renewed
    # until kopf has stopped writing.
    renewing = asyncio.create_task(elector.keep_renewing(), name="kubetune lease renewal")
    status = 0
    try:
        # kopf.operator() is these two steps; between them the signals are taken back from
        # kopf, so that a signal sets `stop` (which kopf watches too) and nothing of kopf's
        # is left waiting for a flag that never comes.
        existing = asyncio.all_tasks()
        tasks = await kopf.spawn_tasks(
            standalone=True,
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            liveness_endpoint=liveness,
            stop_flag=stop,
        )
        _stop_on_signals(stop)
        await kopf.run_tasks(tasks, ignored=existing)
    except Exception:
        log.exception("the operator failed")
        status = 1
    finally:
        renewing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewing
        await elector.release()
        await elector.client.close()
    return status


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()

    def received(sig: signal.Signals) -> None:
        log.info("%s received: stopping", sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, received, sig)


async def serve_standby_health(endpoint: str, elector: leader.LeaseElector) -> web.AppRunner:
    """`/healthz` on the liveness endpoint while this replica stands by (200, who leads)."""
    url = urllib.parse.urlsplit(endpoint)
    path = url.path or "/"

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response(
            {"role": "standby", "identity": elector.identity, "leader": elector.holder}
        )

    app = web.Application()
    app.router.add_get(path, healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, url.hostname, url.port or 80, reuse_address=True)
    await site.start()
    return runner
