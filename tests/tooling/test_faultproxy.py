"""The fault-injecting API proxy of the fault drill (tests/support/faultproxy.py).

The choice of faults is pure and tested as such; the proxy itself runs against a tiny
HTTP server on loopback that answers like an apiserver would (JSON, and a chunked "watch"
whose second event is only sent once the test has seen the first).
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from support.faultproxy import (
    Call,
    Fault,
    FaultProxy,
    faults,
    faults_table,
    parse_call,
    rule,
    select,
    status_body,
)

pytestmark = pytest.mark.tooling

FTJ_STATUS = "/apis/kubetune.io/v1alpha1/namespaces/a/finetunejobs/j1/status"
BATCH_JOBS = "/apis/batch/v1/namespaces/a/jobs"
HUNG_UP = (ConnectionError, http.client.HTTPException)
"""What a client sees of a connection closed without an answer."""

# ---------------------------------------------------------------------- what a request is


@pytest.mark.parametrize(
    ("method", "path", "query", "verb", "key", "namespace", "name"),
    [
        ("GET", "/api/v1/namespaces/a/pods/p", "", "get", "pods", "a", "p"),
        ("GET", "/api/v1/pods", "labelSelector=x", "list", "pods", None, None),
        ("GET", "/api/v1/pods", "watch=true&resourceVersion=5", "watch", "pods", None, None),
        ("GET", "/api/v1/nodes", "watch=1", "watch", "nodes", None, None),
        ("GET", "/api/v1/namespaces/a", "", "get", "namespaces", None, "a"),
        ("PUT", "/api/v1/namespaces/a/finalize", "", "update", "namespaces/finalize", None, "a"),
        ("POST", BATCH_JOBS, "", "create", "jobs.batch", "a", None),
        ("DELETE", f"{BATCH_JOBS}/j1-a1", "", "delete", "jobs.batch", "a", "j1-a1"),
        ("DELETE", BATCH_JOBS, "", "deletecollection", "jobs.batch", "a", None),
        ("PATCH", FTJ_STATUS, "", "patch", "finetunejobs.kubetune.io/status", "a", "j1"),
        (
            "GET",
            "/apis/kubetune.io/v1alpha1/gpupools",
            "",
            "list",
            "gpupools.kubetune.io",
            None,
            None,
        ),
        ("GET", "/version", "", "get", "", None, None),
        ("GET", "/apis", "", "get", "", None, None),
    ],
)
def test_parse_call_names_verb_resource_and_object(
    method: str, path: str, query: str, verb: str, key: str, namespace: str | None, name: str | None
) -> None:
    call = parse_call(method, path, query)
    assert (call.verb, call.key, call.namespace, call.name) == (verb, key, namespace, name)


def test_a_rule_names_a_resource_with_or_without_its_group() -> None:
    call = parse_call("PATCH", FTJ_STATUS)
    assert call.names() == {"finetunejobs.kubetune.io/status", "finetunejobs/status"}
    assert rule(Fault.INVALID, resources=["finetunejobs/status"]).matches(call)
    assert rule(Fault.INVALID, resources=["finetunejobs.kubetune.io/status"]).matches(call)
    assert not rule(Fault.INVALID, resources=["finetunejobs"]).matches(call)
    assert not rule(Fault.INVALID, resources=["jobs.batch"]).matches(call)


# ---------------------------------------------------------------------- which fault


def test_select_applies_filters_rate_and_limit() -> None:
    patch = parse_call("PATCH", FTJ_STATUS, body=b'{"status": {"phase": "Running"}}')
    create = parse_call("POST", BATCH_JOBS)
    only_patches = rule(Fault.INVALID, verbs=["patch"], resources=["finetunejobs/status"])
    assert select([only_patches], create, random.random) is None
    assert select([only_patches], patch, random.random) is only_patches
    assert only_patches.fired == 1

    once = rule(Fault.INVALID, names=["j1"], limit=1)
    assert select([once], patch, random.random) is once
    assert select([once], patch, random.random) is None, "a rule with a limit stops firing"

    other_name = rule(Fault.SERVER_ERROR, names=["j2"])
    other_ns = rule(Fault.SERVER_ERROR, namespaces=["b"])
    assert select([other_name, other_ns], patch, random.random) is None

    running = rule(Fault.INVALID, when=lambda c: (c.json() or {})["status"]["phase"] == "Running")
    succeeded = rule(Fault.INVALID, when=lambda c: (c.json() or {})["status"]["phase"] == "X")
    assert select([succeeded, running], patch, random.random) is running


def test_select_draws_once_per_matching_rule_in_order() -> None:
    call = parse_call("POST", BATCH_JOBS)
    never = rule(Fault.THROTTLE, 0.0)
    half = rule(Fault.SERVER_ERROR, 0.5)
    draws = iter([0.9, 0.4])
    # `never` draws 0.9 (no), `half` draws 0.4 (yes).
    assert select([never, half], call, lambda: next(draws)) is half
    draws = iter([0.1, 0.6])
    assert select([never, half], call, lambda: next(draws)) is None


def test_watch_only_faults_and_non_watch_faults() -> None:
    watch = parse_call("GET", "/api/v1/pods", "watch=true")
    get = parse_call("GET", "/api/v1/namespaces/a/pods/p")
    cut = rule(Fault.CUT_WATCH)
    lost = rule(Fault.LOST_REPLY)
    assert select([cut], get, random.random) is None
    assert select([cut], watch, random.random) is cut
    assert select([lost], watch, random.random) is None
    assert select([lost], get, random.random) is lost


def test_conflicts_go_to_updates_and_patches_and_expiry_to_watches() -> None:
    watch = parse_call("GET", "/api/v1/pods", "watch=true")
    patch = parse_call("PATCH", FTJ_STATUS)
    create = parse_call("POST", BATCH_JOBS)
    conflict, expired = rule(Fault.CONFLICT), rule(Fault.EXPIRED_WATCH)
    assert select([conflict], patch, random.random) is conflict
    assert select([conflict], create, random.random) is None  # a create's 409 means it exists
    assert select([conflict], watch, random.random) is None
    assert select([expired], watch, random.random) is expired
    assert select([expired], patch, random.random) is None


def test_fault_rates_are_reproducible_with_a_seed_and_near_their_rate() -> None:
    calls = [parse_call("POST", BATCH_JOBS)] * 4000

    def run(seed: int) -> list[str | None]:
        rng = random.Random(seed)
        rules = [rule(Fault.THROTTLE, 0.05), rule(Fault.UNAVAILABLE, 0.10)]
        return [
            (chosen.fault.value if (chosen := select(rules, c, rng.random)) else None)
            for c in calls
        ]

    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert first != other
    assert 0.04 < first.count("429") / len(calls) < 0.06
    # The second rule sees only what the first let through: 0.95 × 0.10.
    assert 0.08 < first.count("503") / len(calls) < 0.11


def test_rate_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="rate must be within"):
        rule(Fault.THROTTLE, 1.5)


def test_status_bodies_look_like_the_apiservers() -> None:
    call = parse_call("PATCH", FTJ_STATUS)
    invalid = status_body(Fault.INVALID, call, "status.progress.percent")
    assert invalid["kind"] == "Status" and invalid["code"] == 422
    assert invalid["reason"] == "Invalid"
    assert invalid["details"]["causes"][0]["field"] == "status.progress.percent"
    assert invalid["details"] | {"name": "j1", "group": "kubetune.io"} == invalid["details"]
    throttled = status_body(Fault.THROTTLE, call)
    assert (throttled["code"], throttled["reason"]) == (429, "TooManyRequests")
    assert throttled["details"]["retryAfterSeconds"] == 1
    assert status_body(Fault.SERVER_ERROR, call)["code"] == 500
    assert status_body(Fault.UNAVAILABLE, call)["reason"] == "ServiceUnavailable"


def test_a_conflict_looks_like_the_apiservers() -> None:
    body = status_body(Fault.CONFLICT, parse_call("PATCH", FTJ_STATUS))
    assert (body["code"], body["reason"]) == (409, "Conflict")
    assert body["message"].startswith('Operation cannot be fulfilled on finetunejobs "j1"')


def test_faults_table_lists_kinds_in_a_fixed_order() -> None:
    from collections import Counter

    assert faults_table(Counter({"503": 2, "429": 1, "refused": 4})) == "429=1 503=2 refused=4"


# ---------------------------------------------------------------------- the proxy, live


class Upstream:
    """An "apiserver" on loopback: echoes requests as JSON; `?watch=true` streams two
    events, the second once `release` is set."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bytes]] = []
        self.release = threading.Event()
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                upstream.seen.append((self.command, self.path, body))
                if "watch=true" in self.path:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for n in (1, 2):
                        if n == 2 and not upstream.release.wait(10):
                            return
                        event = json.dumps({"type": "ADDED", "n": n}).encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    return
                data = json.dumps(
                    {
                        "method": self.command,
                        "path": self.path,
                        "body": body.decode(),
                        "x-test": self.headers.get("X-Test"),
                    }
                ).encode()
                self.send_response(201 if self.command == "POST" else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    yield server
    server.close()


@pytest.fixture
def proxy(upstream: Upstream) -> Iterator[FaultProxy]:
    with FaultProxy(upstream.url, seed=1) as running:
        yield running


def request(
    proxy: FaultProxy, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"X-Test": "kept", "Content-Type": "application/json"}
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.headers), json.loads(response.read() or b"null")
    finally:
        conn.close()


def test_forwards_requests_and_answers_faithfully(proxy: FaultProxy, upstream: Upstream) -> None:
    status, _, echo = request(proxy, "PATCH", FTJ_STATUS + "?fieldManager=x", {"status": {}})
    assert status == 200
    assert echo == {
        "method": "PATCH",
        "path": FTJ_STATUS + "?fieldManager=x",
        "body": '{"status": {}}',
        "x-test": "kept",
    }
    status, _, _ = request(proxy, "POST", BATCH_JOBS, {"kind": "Job"})
    assert status == 201
    assert proxy.forwarded == 2 and not proxy.injected()
    assert [r.call.verb for r in proxy.calls()] == ["patch", "create"]
    assert [r.status for r in proxy.calls(resource="finetunejobs/status", name="j1")] == [200]


def test_streams_a_watch_chunk_by_chunk(proxy: FaultProxy, upstream: Upstream) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("GET", "/api/v1/pods?watch=true")
    response = conn.getresponse()
    assert response.status == 200
    assert response.headers["Transfer-Encoding"] == "chunked"
    # The first event arrives while the upstream still holds the second back.
    first = json.loads(response.readline())
    assert first == {"type": "ADDED", "n": 1}
    upstream.release.set()
    assert json.loads(response.readline()) == {"type": "ADDED", "n": 2}
    assert response.read() == b""
    conn.close()


def test_answers_injected_statuses_only_where_the_rule_says(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    proxy.set_rules(
        [
            rule(Fault.INVALID, verbs=["patch"], resources=["finetunejobs/status"], limit=1),
            rule(Fault.THROTTLE, verbs=["create"], resources=["jobs.batch"]),
        ]
    )
    status, headers, body = request(proxy, "PATCH", FTJ_STATUS, {"status": {"phase": "Running"}})
    assert status == 422 and body["details"]["causes"][0]["field"] == "status.phase"
    # Exactly what kube-apiserver sends: lightkube parses a Status only from this type.
    assert headers["Content-Type"] == "application/json"
    status, headers, body = request(proxy, "POST", BATCH_JOBS, {"kind": "Job"})
    assert (status, headers["Retry-After"], body["reason"]) == (429, "1", "TooManyRequests")
    assert request(proxy, "PATCH", FTJ_STATUS, {"status": {}})[0] == 200, "limit 1"
    assert request(proxy, "GET", "/api/v1/namespaces/a/pods/p")[0] == 200
    assert proxy.injected() == {"422": 1, "429": 1}
    assert [p for _, p, _ in upstream.seen] == [FTJ_STATUS, "/api/v1/namespaces/a/pods/p"]


def test_drop_and_lost_reply_close_the_connection(proxy: FaultProxy, upstream: Upstream) -> None:
    with faults(proxy, [rule(Fault.DROP, verbs=["create"])]), pytest.raises(HUNG_UP):
        request(proxy, "POST", BATCH_JOBS, {"n": 1})
    assert upstream.seen == [], "a dropped request never reaches the apiserver"
    with faults(proxy, [rule(Fault.LOST_REPLY, verbs=["create"])]), pytest.raises(HUNG_UP):
        request(proxy, "POST", BATCH_JOBS, {"n": 2})
    assert [b for _, _, b in upstream.seen] == [b'{"n": 2}'], "a lost reply's request arrived"
    assert proxy.injected() == {"drop": 1, "lost-reply": 1}
    assert request(proxy, "POST", BATCH_JOBS, {"n": 3})[0] == 201, "rules are gone"


def test_slow_answers_arrive_late_and_unchanged(proxy: FaultProxy, upstream: Upstream) -> None:
    proxy.set_rules([rule(Fault.SLOW, verbs=["create"], delay=(0.6, 0.6))])
    t0 = time.monotonic()
    status, _, echo = request(proxy, "POST", BATCH_JOBS, {"n": 1})
    assert time.monotonic() - t0 >= 0.6
    assert status == 201 and echo["body"] == '{"n": 1}'
    assert proxy.injected() == {"slow": 1}


def test_an_expired_watch_gets_a_410_event_and_ends(proxy: FaultProxy, upstream: Upstream) -> None:
    proxy.set_rules([rule(Fault.EXPIRED_WATCH, limit=1)])
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("GET", "/api/v1/pods?watch=true&resourceVersion=1")
    response = conn.getresponse()
    assert response.status == 200
    event = json.loads(response.readline())
    assert event["type"] == "ERROR"
    assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")
    assert response.read() == b""
    conn.close()
    assert upstream.seen == [], "the apiserver never saw the expired watch"
    assert proxy.injected() == {"410": 1}


def test_cut_watch_ends_a_stream_midway(proxy: FaultProxy, upstream: Upstream) -> None:
    proxy.set_rules([rule(Fault.CUT_WATCH, cut_after=(0.3, 0.3))])
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("GET", "/api/v1/pods?watch=true")
    response = conn.getresponse()
    assert json.loads(response.readline()) == {"type": "ADDED", "n": 1}
    t0 = time.monotonic()
    with pytest.raises(HUNG_UP):
        response.read()  # the upstream holds event 2 back; the proxy cuts the stream
    assert time.monotonic() - t0 < 5
    assert proxy.injected() == {"cut-watch": 1}
    conn.close()


def test_cut_streams_cuts_open_watches(proxy: FaultProxy, upstream: Upstream) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("GET", "/api/v1/pods?watch=true")
    response = conn.getresponse()
    assert json.loads(response.readline()) == {"type": "ADDED", "n": 1}
    assert proxy.cut_streams() == 1
    with pytest.raises(HUNG_UP):
        response.read()
    assert proxy.injected() == {"cut-watch": 1}
    assert proxy.cut_streams() == 0
    conn.close()


def test_outage_refuses_connections_cuts_streams_and_ends(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("GET", "/api/v1/pods?watch=true")
    response = conn.getresponse()
    assert json.loads(response.readline())["n"] == 1
    proxy.outage(0.5)
    assert proxy.down
    with pytest.raises(HUNG_UP):
        response.read()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", proxy.port)):
        pass
    deadline = time.monotonic() + 5
    while proxy.down and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not proxy.down
    assert request(proxy, "GET", "/api/v1/namespaces/a/pods/p")[0] == 200
    # An outage without an end lasts until end_outage.
    proxy.outage()
    time.sleep(0.2)
    assert proxy.down
    proxy.end_outage()
    assert request(proxy, "GET", "/api/v1/namespaces/a/pods/p")[0] == 200


def test_an_unreachable_upstream_looks_like_a_dropped_connection() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with FaultProxy(dead) as proxy, pytest.raises(HUNG_UP):
        request(proxy, "GET", "/api/v1/pods")


def test_call_json_is_none_for_a_body_that_is_not_json() -> None:
    assert Call("PATCH", "patch", body=b"not json").json() is None
    assert Call("GET", "get").json() is None
