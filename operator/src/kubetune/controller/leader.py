"""Leader election over a `coordination.k8s.io/v1` Lease: several replicas, one active.

Every replica is a candidate. The one whose identity is the Lease's `holderIdentity` is the
leader and runs the operator; it renews the Lease every `retry` seconds. The others poll it
at the same rate and take it over once it is free (no holder, or deleted) or has not been
renewed for `leaseDurationSeconds`, judged by the candidate's own clock since it last saw the
record change (as Kubernetes' own controllers do), so clock skew between nodes cannot make
two leaders. Every write carries the `resourceVersion` it was decided on: when two candidates
race, the API server accepts one write and answers the other 409 Conflict.

Fencing: the leader may write only until `renewDeadline` seconds after it last sent a
renewal that succeeded. `may_write()` says whether that is still so (a cheap clock check, for
the operator's own write paths), and a watchdog thread ends the process with
`EXIT_LEASE_LOST` the moment it is not, even when the event loop is stuck. Since
`renewDeadline < leaseDurationSeconds`, a fenced leader is gone before any candidate can take
the Lease over. The hard exit is what stops kopf's own writes (finalizers, annotations,
status patches it makes for us); the pod restarts and becomes a candidate again.

Its settings come from the environment (KUBETUNE_LEADER_ELECTION and KUBETUNE_LEASE_*, read
by controller/settings with the operator's others; docs/configuration.md lists them).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

log = logging.getLogger("kubetune.leader")

EXIT_LEASE_LOST = 3
"""Exit status of a replica that lost the Lease (kopf's own failures exit with 1)."""

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class LeadershipLost(RuntimeError):
    """This replica does not (or no longer) hold the Lease: it must not write."""


# ---------------------------------------------------------------------- settings


@dataclass(frozen=True)
class LeaderSettings:
    enabled: bool = False
    lease_name: str = "kubetune"
    lease_namespace: str = ""
    identity: str = ""
    lease_duration_s: int = 15
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def validate(self) -> LeaderSettings:
        """Raise ValueError with a "To fix:" hint when the settings cannot work."""
        if not _DNS_SUBDOMAIN.match(self.lease_name) or len(self.lease_name) > 253:
            raise ValueError(
                f"KUBETUNE_LEASE_NAME={self.lease_name!r} is not a valid object name. To fix: "
                "use lower-case letters, digits, '-' and '.', e.g. 'kubetune'"
            )
        if self.enabled and not self.lease_namespace:
            raise ValueError(
                "leader election needs the Lease's namespace, and none was found (no "
                "KUBETUNE_LEASE_NAMESPACE, no POD_NAMESPACE, no service account namespace "
                f"file {SERVICE_ACCOUNT_NAMESPACE}). To fix: set KUBETUNE_LEASE_NAMESPACE; "
                "the Helm chart sets POD_NAMESPACE from the downward API"
            )
        if self.lease_namespace and not _DNS_LABEL.match(self.lease_namespace):
            raise ValueError(
                f"the Lease's namespace {self.lease_namespace!r} is not a namespace name. "
                "To fix: set KUBETUNE_LEASE_NAMESPACE to an existing namespace"
            )
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "the lease timings must satisfy 0 < KUBETUNE_LEASE_RETRY_SECONDS "
                f"({self.retry_period_s:g}) < KUBETUNE_LEASE_RENEW_DEADLINE_SECONDS "
                f"({self.renew_deadline_s:g}) < KUBETUNE_LEASE_DURATION_SECONDS "
                f"({self.lease_duration_s}): the leader must stop before a standby may take "
                "over, and must get several tries to renew. To fix: keep the defaults "
                "(2 < 10 < 15) or scale all three together"
            )
        return self


def default_identity(env: Mapping[str, str]) -> str:
    """POD_NAME (or the host name) plus a random suffix: unique for each process."""
    base = env.get("POD_NAME") or socket.gethostname() or "kubetune"
    return f"{base}_{secrets.token_hex(3)}"


def default_namespace(env: Mapping[str, str], sa_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    with contextlib.suppress(OSError):
        return sa_file.read_text().strip()
    return ""


# ---------------------------------------------------------------------- decisions (pure)


@dataclass(frozen=True)
class LeaseRecord:
    """What the Lease says, and the version it was read at."""

    holder: str
    duration_s: int
    transitions: int
    renew_time: datetime | None
    acquire_time: datetime | None
    resource_version: str

    @property
    def sign_of_life(self) -> tuple[str, datetime | None, int]:
        """Changes whenever the holder renews or the holder changes."""
        return (self.holder, self.renew_time, self.transitions)


class Action(enum.Enum):
    CREATE = "create"  # no Lease yet: create it, holding it
    TAKE = "take"  # free or expired: take it over (one more transition)
    RENEW = "renew"  # ours: renew it
    WAIT = "wait"  # someone else holds it and has renewed it in time


def expired(record: LeaseRecord, unchanged_for_s: float, default_duration_s: float) -> bool:
    """Free (no holder), or not renewed for its duration as this candidate's clock saw it."""
    if not record.holder:
        return True
    duration = record.duration_s if record.duration_s > 0 else default_duration_s
    return unchanged_for_s >= duration


def decide(
    record: LeaseRecord | None, identity: str, unchanged_for_s: float, default_duration_s: float
) -> Action:
    """What a candidate does with the Lease it just read (None: there is none)."""
    if record is None:
        return Action.CREATE
    if record.holder == identity:
        return Action.RENEW
    if expired(record, unchanged_for_s, default_duration_s):
        return Action.TAKE
    return Action.WAIT


def next_spec(
    record: LeaseRecord | None, identity: str, duration_s: int, now: datetime
) -> LeaseSpec:
    """The Lease's spec after this candidate acquires or renews it at `now`."""
    ours = record is not None and record.holder == identity
    transitions = 0 if record is None else record.transitions + (0 if ours else 1)
    acquired = record.acquire_time if ours and record is not None else now
    return LeaseSpec(
        holderIdentity=identity,
        leaseDurationSeconds=duration_s,
        acquireTime=acquired or now,
        renewTime=now,
        leaseTransitions=transitions,
    )


def _record(lease: Lease) -> LeaseRecord:
    spec = lease.spec or LeaseSpec()
    meta = lease.metadata or ObjectMeta()
    return LeaseRecord(
        holder=spec.holderIdentity or "",
        duration_s=spec.leaseDurationSeconds or 0,
        transitions=spec.leaseTransitions or 0,
        renew_time=spec.renewTime,
        acquire_time=spec.acquireTime,
        resource_version=meta.resourceVersion or "",
    )


# ---------------------------------------------------------------------- the elector


def fence(reason: str) -> None:
    """Log why and end the process at once: no handler, no cleanup, no further write."""
    log.error("lost the lease: %s; exiting with status %d", reason, EXIT_LEASE_LOST)
    for handler in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(EXIT_LEASE_LOST)


def _utcnow() -> datetime:
    return datetime.now(UTC)


class LeaseElector:
    """Acquire, renew and release one Lease for this process."""

    def __init__(
        self,
        client: AsyncClient,
        settings: LeaderSettings,
        *,
        on_lost: Callable[[str], None] = fence,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.client = client
        self.settings = settings
        self.identity = settings.identity or default_identity(os.environ)
        self._on_lost = on_lost
        self._clock = clock
        self._wall = wall
        self._leading = False
        self._valid_until = float("-inf")
        self._cached: Lease | None = None  # our own last write, to renew without a read
        self._seen: tuple[tuple[str, datetime | None, int], float] | None = None
        self._lost = False
        self._watchdog: threading.Thread | None = None
        self._watchdog_stop = threading.Event()
        self.holder = ""  # the holder last seen (for logs and the standby's health page)

    # -- the fence, as other code sees it

    @property
    def is_leader(self) -> bool:
        return self._leading

    def may_write(self) -> bool:
        """True only while this replica holds the Lease within its renew deadline."""
        return self._leading and self._clock() < self._valid_until

    def raise_unless_leader(self) -> None:
        if not self.may_write():
            raise LeadershipLost(
                f"{self.identity} does not hold the lease {self._where}; it must not write"
            )

    @property
    def _where(self) -> str:
        return f"{self.settings.lease_namespace}/{self.settings.lease_name}"

    # -- one round: read, decide, write

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the Lease afterwards.

        Raises ApiError for answers other than 404 on read and 409 on write, and whatever
        the transport raises; the caller retries.
        """
        lease = self._cached if self._leading else None
        if lease is None:
            lease = await self._read()
        record = None if lease is None else _record(lease)
        action = decide(
            record, self.identity, self._unchanged_for(record), self.settings.lease_duration_s
        )
        if record is not None:
            self.holder = record.holder
        if action is Action.WAIT:
            if self._leading and record is not None:
                self._lose(f"{record.holder} holds it now")
            return False
        sent = self._clock()
        spec = next_spec(record, self.identity, self.settings.lease_duration_s, self._wall())
        try:
            if lease is None:
                written = await self.client.create(
                    Lease(
                        metadata=ObjectMeta(
                            name=self.settings.lease_name,
                            namespace=self.settings.lease_namespace,
                        ),
                        spec=spec,
                    )
                )
            else:
                written = await self.client.replace(replace_spec(lease, spec))
        except ApiError as exc:
            if exc.status.code == 409:  # another candidate wrote first, or our cache is stale
                self._cached = None
                log.debug("lease %s: conflict on %s", self._where, action.value)
                return False
            raise
        if not self._leading:
            log.info(
                "acquired the lease %s as %s (transition %d)",
                self._where,
                self.identity,
                spec.leaseTransitions or 0,
            )
        self._leading = True
        self._valid_until = sent + self.settings.renew_deadline_s
        self._cached = written
        self.holder = self.identity
        return True

    async def _read(self) -> Lease | None:
        try:
            return await self.client.get(
                Lease, self.settings.lease_name, namespace=self.settings.lease_namespace
            )
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise

    def _unchanged_for(self, record: LeaseRecord | None) -> float:
        """Seconds since this candidate first saw the record as it is now."""
        now = self._clock()
        if record is None:
            self._seen = None
            return 0.0
        key = record.sign_of_life
        if self._seen is None or self._seen[0] != key:
            self._seen = (key, now)
        return now - self._seen[1]

    # -- loops

    async def acquire(self, stop: asyncio.Event | None = None) -> bool:
        """Poll until this replica holds the Lease (True) or `stop` is set (False)."""
        log.info(
            "waiting for the lease %s as %s (duration %ds, renew deadline %gs, retry %gs)",
            self._where,
            self.identity,
            self.settings.lease_duration_s,
            self.settings.renew_deadline_s,
            self.settings.retry_period_s,
        )
        last_holder = None
        while stop is None or not stop.is_set():
            try:
                async with asyncio.timeout(self.settings.renew_deadline_s):
                    if await self.try_acquire_or_renew():
                        self._start_watchdog()
                        return True
            except Exception as exc:  # the API server may be away for a while
                self._warn(exc)
            if self.holder and self.holder != last_holder:
                last_holder = self.holder
                log.info("the lease %s is held by %s; standing by", self._where, self.holder)
            await _sleep_or_stop(self.settings.retry_period_s, stop)
        return False

    async def keep_renewing(self) -> None:
        """Renew every retry period until cancelled; the watchdog fences a late renewal."""
        while not self._lost:
            await asyncio.sleep(self.settings.retry_period_s)
            remaining = self._valid_until - self._clock()
            if remaining <= 0:
                self._lose(f"no renewal for {self.settings.renew_deadline_s:g}s")
                return
            try:
                async with asyncio.timeout(remaining):
                    await self.try_acquire_or_renew()
            except TimeoutError:
                log.warning("lease %s: renewal did not answer in time", self._where)
            except Exception as exc:
                self._warn(exc)

    async def release(self) -> None:
        """Give the Lease up (after the operator stopped), so a standby takes over at once."""
        self._stop_watchdog()
        if not self._leading:
            return
        self._leading = False
        try:
            lease = await self._read()
            if lease is None or _record(lease).holder != self.identity:
                return
            old = lease.spec or LeaseSpec()
            spec = LeaseSpec(
                holderIdentity="",
                leaseDurationSeconds=old.leaseDurationSeconds,
                acquireTime=old.acquireTime,
                renewTime=self._wall(),
                leaseTransitions=old.leaseTransitions,
            )
            await self.client.replace(replace_spec(lease, spec))
            log.info("released the lease %s", self._where)
        except Exception as exc:  # a standby takes over once the lease expires
            log.warning("could not release the lease %s: %s", self._where, exc)

    # -- losing it

    def _lose(self, reason: str) -> None:
        if self._lost:
            return
        self._lost = True
        self._leading = False
        self._on_lost(f"{self._where}: {reason}")

    def _start_watchdog(self) -> None:
        if self._watchdog is not None:
            return
        self._watchdog_stop.clear()
        self._watchdog = threading.Thread(
            target=self._watch, name="kubetune-lease-watchdog", daemon=True
        )
        self._watchdog.start()

    def _stop_watchdog(self) -> None:
        self._watchdog_stop.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=2)
        self._watchdog = None

    def _watch(self) -> None:
        """A thread, so that a stuck event loop cannot keep a stale leader alive."""
        interval = min(0.25, self.settings.retry_period_s / 4)
        while not self._watchdog_stop.wait(interval):
            if self._leading and self._clock() >= self._valid_until:
                self._lose(f"no renewal for {self.settings.renew_deadline_s:g}s")
                return

    def _warn(self, exc: Exception) -> None:
        if isinstance(exc, ApiError) and exc.status.code == 403:
            log.error(
                "lease %s: forbidden (%s). To fix: let the service account get, create and "
                "update leases.coordination.k8s.io in %s (the Helm chart's Role does)",
                self._where,
                exc.status.message,
                self.settings.lease_namespace,
            )
        else:
            log.warning("lease %s: %s: %s", self._where, type(exc).__name__, exc)


def replace_spec(lease: Lease, spec: LeaseSpec) -> Lease:
    """The Lease with a new spec, keeping its metadata (resourceVersion included)."""
    return Lease(metadata=lease.metadata, spec=spec)


async def _sleep_or_stop(seconds: float, stop: asyncio.Event | None) -> None:
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


# ---------------------------------------------------------------------- process-wide fence

_active: LeaseElector | None = None


def install(elector: LeaseElector | None) -> None:
    """Make `elector` the one `may_write()` asks (None: no leader election, always True)."""
    global _active
    _active = elector


def active() -> LeaseElector | None:
    return _active


def may_write() -> bool:
    """Cheap and non-blocking: may this process write to the cluster right now?"""
    elector = _active
    return True if elector is None else elector.may_write()


def raise_unless_leader() -> None:
    """Raise LeadershipLost unless `may_write()`."""
    elector = _active
    if elector is not None:
        elector.raise_unless_leader()
