"""A reverse proxy in front of a kube-apiserver that injects API faults, for fault drills.

The operator under test talks plain HTTP to the proxy on 127.0.0.1; the proxy forwards
every request to the real apiserver over TLS with the admin client certificate and streams
the answer back as it comes (a watch's chunks are written the moment they arrive, so a
watch through the proxy is as long-lived and as prompt as one without it).

Faults are chosen per request by `Rule`s, which may be changed while the proxy runs (from
any thread):

- an answer instead of the apiserver's: 429 (with `Retry-After`), 500, 503, 422 (a
  `Status` the way kube-apiserver writes one for an invalid object, naming a field), or 409
  (`Conflict`: the object was modified meanwhile; given to updates and patches only);
- `SLOW`: the request is forwarded after `Rule.delay` seconds (a loaded apiserver);
- `EXPIRED_WATCH`: a watch is answered the way kube-apiserver answers one whose
  resourceVersion is too old: HTTP 200, one `ERROR` event carrying a 410 `Expired` Status,
  and the end of the stream (the client must list again);
- `DROP`: the connection is closed before the request reaches the apiserver;
- `LOST_REPLY`: the apiserver gets the request and acts on it, the client never hears back
  (the case that tests whether a retried create is recognised as one's own);
- `CUT_WATCH`: a watch stream is cut after a few seconds, mid-stream;
- an outage (`outage()` / `end_outage()`): the listening socket closes (connection refused)
  and every open connection is cut, until the outage ends.

A rule matches on Kubernetes verb (get, list, watch, create, update, patch, delete,
deletecollection), resource (`pods`, `jobs.batch`, `finetunejobs/status`, ...), namespace,
name and an optional predicate; it fires with its `rate` (one seeded random stream for the
whole proxy, so a run is reproducible up to the order requests arrive in) and at most
`limit` times. What was injected is counted, and every request is recorded (`calls`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import parse_qs

import aiohttp
from aiohttp import web


class Fault(StrEnum):
    THROTTLE = "429"
    SERVER_ERROR = "500"
    UNAVAILABLE = "503"
    INVALID = "422"
    DROP = "drop"
    """The connection closes before the request is forwarded."""
    LOST_REPLY = "lost-reply"
    """The request is forwarded and acted on; the connection closes before the answer."""
    CUT_WATCH = "cut-watch"
    """A watch is forwarded and streamed, then cut after `Rule.cut_after` seconds."""
    CONFLICT = "409"
    """An update or patch is answered 409 Conflict (the object changed meanwhile)."""
    SLOW = "slow"
    """The request is forwarded after `Rule.delay` seconds."""
    EXPIRED_WATCH = "410"
    """A watch gets one ERROR event with a 410 Expired Status, then its stream ends."""


ANSWERS = {
    Fault.THROTTLE: (429, "TooManyRequests", "Too many requests, please try again later."),
    Fault.SERVER_ERROR: (500, "InternalError", "Internal error occurred: injected fault"),
    Fault.UNAVAILABLE: (503, "ServiceUnavailable", "The server is currently unavailable"),
    Fault.INVALID: (422, "Invalid", "is invalid"),
    Fault.CONFLICT: (
        409,
        "Conflict",
        "the object has been modified; please apply your changes to the latest version and "
        "try again",
    ),
}
"""Faults answered with a Status: HTTP code, Status reason, message."""

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "authorization",
    }
)


# ---------------------------------------------------------------------- what a request is


@dataclass(frozen=True)
class Call:
    """One API request as a Kubernetes verb on a resource."""

    method: str
    verb: str
    group: str = ""
    resource: str = ""
    """The plural resource name; empty for discovery and other non-resource paths."""
    subresource: str = ""
    namespace: str | None = None
    name: str | None = None
    body: bytes = b""

    @property
    def key(self) -> str:
        """`resource[.group][/subresource]`: `jobs.batch`, `finetunejobs.kubetune.io/status`."""
        base = f"{self.resource}.{self.group}" if self.group else self.resource
        return f"{base}/{self.subresource}" if self.subresource else base

    def names(self) -> frozenset[str]:
        """The resource spellings a rule may use for this call (with or without group)."""
        short = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return frozenset({self.key, short})

    def json(self) -> Any:
        """The request body as JSON (None when it is not)."""
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None


def parse_call(method: str, path: str, query: str = "", body: bytes = b"") -> Call:
    """The Kubernetes verb, resource and object of a request path (`/api/v1/...`,
    `/apis/<group>/<version>/...`); other paths (discovery, /version) have no resource."""
    method = method.upper()
    parts = [p for p in path.split("/") if p]
    group, rest = "", []
    if parts[:1] == ["api"] and len(parts) >= 2:
        rest = parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    namespace: str | None = None
    resource, name, sub = "", None, ""
    if rest[:1] == ["namespaces"] and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    if rest:
        resource = rest[0]
        name = rest[1] if len(rest) > 1 else None
        sub = "/".join(rest[2:])
    watching = parse_qs(query).get("watch", [""])[-1].lower() in ("1", "true")
    if method == "GET":
        verb = "watch" if watching else ("list" if resource and not name else "get")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())
    return Call(method, verb, group, resource, sub, namespace, name, body)


# ---------------------------------------------------------------------- which fault


@dataclass
class Rule:
    """Inject `fault` into a fraction `rate` of the calls this rule matches.

    Empty `verbs`, `resources`, `namespaces` or `names` match anything; `when` is a further
    predicate on the call; `limit` caps how often the rule fires (None: no cap).
    """

    fault: Fault
    rate: float = 1.0
    verbs: frozenset[str] = frozenset()
    resources: frozenset[str] = frozenset()
    namespaces: frozenset[str] = frozenset()
    names: frozenset[str] = frozenset()
    when: Callable[[Call], bool] | None = None
    limit: int | None = None
    cut_after: tuple[float, float] = (1.0, 8.0)
    """For CUT_WATCH: the stream is cut after a uniformly drawn number of seconds."""
    field_path: str = "status.phase"
    """For INVALID: the field the 422 names."""
    delay: tuple[float, float] = (1.0, 3.0)
    """For SLOW: the request waits a uniformly drawn number of seconds."""
    fired: int = 0

    def matches(self, call: Call) -> bool:
        return (
            (not self.verbs or call.verb in self.verbs)
            and (not self.resources or bool(self.resources & call.names()))
            and (not self.namespaces or call.namespace in self.namespaces)
            and (not self.names or call.name in self.names)
            and (self.limit is None or self.fired < self.limit)
            and (self.when is None or self.when(call))
        )


def rule(
    fault: Fault,
    rate: float = 1.0,
    *,
    verbs: Iterable[str] = (),
    resources: Iterable[str] = (),
    namespaces: Iterable[str] = (),
    names: Iterable[str] = (),
    when: Callable[[Call], bool] | None = None,
    limit: int | None = None,
    cut_after: tuple[float, float] = (1.0, 8.0),
    field_path: str = "status.phase",
    delay: tuple[float, float] = (1.0, 3.0),
) -> Rule:
    """A `Rule` from plain iterables."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be within [0, 1], not {rate}")
    return Rule(
        fault,
        rate,
        frozenset(verbs),
        frozenset(resources),
        frozenset(namespaces),
        frozenset(names),
        when,
        limit,
        cut_after,
        field_path,
        delay,
    )


def select(rules: Sequence[Rule], call: Call, draw: Callable[[], float]) -> Rule | None:
    """The first matching rule whose draw falls under its rate (it is counted as fired).

    Each matching rule draws once, in order; a watch is never given LOST_REPLY or CONFLICT,
    only a watch is given CUT_WATCH or EXPIRED_WATCH, and only an update or a patch CONFLICT.
    """
    for candidate in rules:
        watch_only = candidate.fault in (Fault.CUT_WATCH, Fault.EXPIRED_WATCH)
        if watch_only and call.verb != "watch":
            continue
        if candidate.fault is Fault.LOST_REPLY and call.verb == "watch":
            continue
        if candidate.fault is Fault.CONFLICT and call.verb not in ("update", "patch"):
            continue
        if candidate.matches(call) and draw() < candidate.rate:
            candidate.fired += 1
            return candidate
    return None


def status_body(fault: Fault, call: Call, field_path: str = "status.phase") -> dict[str, Any]:
    """The `Status` kube-apiserver would answer with for this fault."""
    code, reason, message = ANSWERS[fault]
    kind = call.resource or "unknown"
    details: dict[str, Any] = {"kind": kind}
    if call.group:
        details["group"] = call.group
    if call.name:
        details["name"] = call.name
    if fault is Fault.INVALID:
        invalid = "Invalid value: injected by the fault proxy"
        message = f'{kind}.{call.group or "core"} "{call.name}" is invalid: {field_path}: {invalid}'
        details["causes"] = [
            {"reason": "FieldValueInvalid", "message": invalid, "field": field_path}
        ]
    if fault is Fault.THROTTLE:
        details["retryAfterSeconds"] = 1
    if fault is Fault.CONFLICT:
        message = f'Operation cannot be fulfilled on {kind} "{call.name}": {message}'
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }


# ---------------------------------------------------------------------- the proxy


@dataclass(frozen=True)
class Record:
    """One request the proxy saw: when (time.time()), what, and what it did."""

    at: float
    call: Call
    fault: Fault | None
    status: int | None
    """The HTTP status the client got; None when it got no answer."""


@dataclass
class _Shared:
    lock: threading.Lock = field(default_factory=threading.Lock)
    rules: list[Rule] = field(default_factory=list)
    injected: Counter[str] = field(default_factory=Counter)
    records: list[Record] = field(default_factory=list)
    forwarded: int = 0
    refused: int = 0
    down: bool = False


class FaultProxy:
    """The proxy, on its own thread and event loop; `url` is what clients connect to."""

    def __init__(
        self,
        upstream: str,
        ssl_context: ssl.SSLContext | None = None,
        *,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        max_records: int = 200_000,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.ssl_context = ssl_context
        self.host = host
        self.port = port
        self.max_records = max_records
        self._rng = random.Random(seed)
        self._shared = _Shared()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.ServerRunner | None = None
        self._site: web.TCPSite | None = None
        self._session: aiohttp.ClientSession | None = None
        self._streams: set[asyncio.Transport] = set()
        self._stopping: asyncio.Event | None = None
        self._outage_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ life cycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> FaultProxy:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(ready))
            except BaseException as exc:  # surfaced by start()
                failure.append(exc)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="faultproxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise RuntimeError("the fault proxy did not start")
        if failure:
            raise RuntimeError(f"the fault proxy did not start: {failure[0]!r}") from failure[0]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stopping.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _serve(self, ready: threading.Event) -> None:
        self._stopping = asyncio.Event()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self.ssl_context or False, limit=0),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        )
        self._runner = web.ServerRunner(
            web.Server(self._handle, handler_cancellation=True), access_log=None
        )
        await self._runner.setup()
        await self._listen()
        ready.set()
        try:
            await self._stopping.wait()
        finally:
            self._cut_everything()
            await self._runner.cleanup()
            await self._session.close()

    async def _listen(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await self._site.start()
        sockets = self._runner.addresses
        if self.port == 0 and sockets:
            self.port = int(sockets[0][1])

    def _call_soon(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the proxy's loop (awaiting it when it is a coroutine) and wait."""
        assert self._loop is not None

        async def wrapper() -> Any:
            result = fn()
            if asyncio.iscoroutine(result):
                return await result
            return result

        return asyncio.run_coroutine_threadsafe(wrapper(), self._loop).result(10.0)

    # ------------------------------------------------------------------ controls

    def set_rules(self, rules: Iterable[Rule]) -> None:
        """Replace the rules (an empty list: forward everything faithfully)."""
        with self._shared.lock:
            self._shared.rules = list(rules)

    def add_rule(self, new: Rule) -> Rule:
        with self._shared.lock:
            self._shared.rules.append(new)
        return new

    def clear_rules(self) -> None:
        self.set_rules(())

    def outage(self, seconds: float | None = None) -> None:
        """Refuse everything: stop listening and cut every connection, for `seconds` (None:
        until `end_outage`)."""

        async def go_down() -> None:
            with self._shared.lock:
                self._shared.down = True
            if self._site is not None:
                await self._site.stop()
                self._site = None
            self._cut_everything()
            if self._outage_timer is not None:
                self._outage_timer.cancel()
                self._outage_timer = None
            if seconds is not None:
                loop = asyncio.get_running_loop()
                self._outage_timer = loop.call_later(
                    seconds, lambda: loop.create_task(self._come_back())
                )

        self._call_soon(go_down)

    def end_outage(self) -> None:
        self._call_soon(self._come_back)

    async def _come_back(self) -> None:
        if self._outage_timer is not None:
            self._outage_timer.cancel()
            self._outage_timer = None
        if self._site is None:
            await self._listen()
        with self._shared.lock:
            self._shared.down = False

    def cut_streams(self) -> int:
        """Cut every response being streamed now (open watches), as CUT_WATCH faults; how
        many. Clients reconnect, and their new watches pass through the rules."""

        def cut() -> int:
            streams = list(self._streams)
            for transport in streams:
                transport.abort()
            self._streams.clear()
            with self._shared.lock:
                self._shared.injected[str(Fault.CUT_WATCH)] += len(streams)
            return len(streams)

        return int(self._call_soon(cut))

    @property
    def down(self) -> bool:
        with self._shared.lock:
            return self._shared.down

    def _cut_everything(self) -> None:
        if self._runner is not None and self._runner.server is not None:
            for conn in self._runner.server.connections:
                if conn.transport is not None:
                    conn.transport.abort()
        for transport in list(self._streams):
            transport.abort()
        self._streams.clear()

    # ------------------------------------------------------------------ what happened

    def injected(self) -> Counter[str]:
        """Faults injected so far by kind (`Fault` values), plus `refused` (requests that
        arrived on an open connection during an outage)."""
        with self._shared.lock:
            counts = Counter(self._shared.injected)
            if self._shared.refused:
                counts["refused"] = self._shared.refused
            return counts

    @property
    def forwarded(self) -> int:
        with self._shared.lock:
            return self._shared.forwarded

    def calls(
        self,
        *,
        verb: str | None = None,
        resource: str | None = None,
        namespace: str | None = None,
        name: str | None = None,
        since: float | None = None,
    ) -> list[Record]:
        """The recorded requests that match every given filter (`resource` as in rules)."""
        with self._shared.lock:
            records = list(self._shared.records)
        return [
            r
            for r in records
            if (verb is None or r.call.verb == verb)
            and (resource is None or resource in r.call.names())
            and (namespace is None or r.call.namespace == namespace)
            and (name is None or r.call.name == name)
            and (since is None or r.at >= since)
        ]

    def reset_counts(self) -> None:
        with self._shared.lock:
            self._shared.injected.clear()
            self._shared.records.clear()
            self._shared.forwarded = 0
            self._shared.refused = 0

    def _record(self, call: Call, fault: Fault | None, status: int | None) -> None:
        with self._shared.lock:
            if fault is not None:
                self._shared.injected[str(fault)] += 1
            if len(self._shared.records) < self.max_records:
                self._shared.records.append(Record(time.time(), call, fault, status))

    # ------------------------------------------------------------------ one request

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read() if request.body_exists else b""
        call = parse_call(request.method, request.path, request.query_string, body)
        chosen, cut_at, delay = None, 0.0, 0.0
        with self._shared.lock:
            down = self._shared.down
            if down:
                self._shared.refused += 1
            else:
                chosen = select(self._shared.rules, call, self._rng.random)
                if chosen is not None and chosen.fault is Fault.CUT_WATCH:
                    cut_at = self._rng.uniform(*chosen.cut_after)
                if chosen is not None and chosen.fault is Fault.SLOW:
                    delay = self._rng.uniform(*chosen.delay)
        if down:
            return self._hang_up(request, call, None)
        fault = chosen.fault if chosen else None
        if fault is Fault.EXPIRED_WATCH:
            return self._expired(call)
        if delay:
            await asyncio.sleep(delay)
        if chosen is not None and fault in ANSWERS:
            assert fault is not None
            status = status_body(fault, call, chosen.field_path)
            headers = {"Content-Type": "application/json"}
            if fault is Fault.THROTTLE:
                headers["Retry-After"] = "1"
            self._record(call, fault, status["code"])
            # Exactly `application/json`, as kube-apiserver sends it (no charset): clients
            # such as lightkube only parse a Status from that content type.
            body = json.dumps(status).encode()
            return web.Response(status=status["code"], body=body, headers=headers)
        if fault is Fault.DROP:
            return self._hang_up(request, call, fault)
        return await self._forward(request, call, fault, cut_at)

    def _expired(self, call: Call) -> web.Response:
        """A watch's answer when its resourceVersion is too old: one ERROR event with a
        410 Expired Status, then the end of the stream."""
        status = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": "too old resource version: injected by the fault proxy",
            "reason": "Expired",
            "code": 410,
        }
        self._record(call, Fault.EXPIRED_WATCH, 200)
        event = json.dumps({"type": "ERROR", "object": status}).encode() + b"\n"
        return web.Response(status=200, body=event, headers={"Content-Type": "application/json"})

    def _hang_up(self, request: web.BaseRequest, call: Call, fault: Fault | None) -> web.Response:
        """Close the client's connection without an answer."""
        if fault is not None:
            self._record(call, fault, None)
        if request.transport is not None:
            request.transport.abort()
        # aiohttp finds the transport gone and writes nothing.
        return web.Response(status=499)

    async def _forward(
        self, request: web.BaseRequest, call: Call, fault: Fault | None, cut_at: float
    ) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        url = self.upstream + request.path_qs
        try:
            upstream = await self._session.request(
                request.method,
                url,
                headers=headers,
                data=call.body if call.body else None,
                allow_redirects=False,
            )
        except (TimeoutError, aiohttp.ClientError, OSError):
            # The apiserver itself is unreachable: the client sees a dropped connection.
            self._record(call, None, None)
            return self._hang_up(request, call, None)
        with self._shared.lock:
            self._shared.forwarded += 1
        async with upstream:
            if fault is Fault.LOST_REPLY:
                await upstream.read()
                return self._hang_up(request, call, fault)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_BY_HOP:
                    response.headers.add(key, value)
            length = upstream.headers.get("Content-Length")
            if length is not None and length.isdigit():
                response.content_length = int(length)
            transport = request.transport
            if transport is None:
                return response
            self._streams.add(transport)
            deadline = time.monotonic() + cut_at if fault is Fault.CUT_WATCH else None
            try:
                await response.prepare(request)
                self._record(call, fault, upstream.status)
                while True:
                    timeout = None if deadline is None else deadline - time.monotonic()
                    if timeout is not None and timeout <= 0:
                        transport.abort()
                        return response
                    try:
                        chunk = await asyncio.wait_for(upstream.content.readany(), timeout)
                    except TimeoutError:
                        continue
                    if not chunk:
                        break
                    await response.write(chunk)
                await response.write_eof()
            except (TimeoutError, ConnectionError, aiohttp.ClientError):
                # Either side went away (an outage cut it, the client closed its watch, the
                # apiserver ended the stream abruptly): end the other side too.
                transport.abort()
            finally:
                self._streams.discard(transport)
            return response


def faults_table(counts: Counter[str]) -> str:
    """`429=3 500=2 ...` in a fixed order, for printing."""
    order = [str(f) for f in Fault] + ["refused"]
    return " ".join(f"{k}={counts[k]}" for k in order if counts.get(k))


@contextlib.contextmanager
def faults(proxy: FaultProxy, rules: Iterable[Rule]) -> Iterator[list[Rule]]:
    """Apply `rules` for the duration of a `with` block (then forward faithfully)."""
    applied = list(rules)
    proxy.set_rules(applied)
    try:
        yield applied
    finally:
        proxy.clear_rules()
