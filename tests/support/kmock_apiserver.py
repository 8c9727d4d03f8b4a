"""KMock's Kubernetes emulator, made to behave like kube-apiserver where kubetune relies on it.

`ApiServerEmulator` closes two gaps between KMock 0.8's `KubernetesEmulator` and a real
kube-apiserver (tests/unit/test_handlers.py shows both on the stock emulator);
`declare_resources` serves the built-in resources and kubetune's CRDs. A third gap is in
KMock's request parsing, shared by every emulator: it reads `/api/v1/namespaces` (the list of
Namespaces) as a namespace prefix with no namespace and fails with a 500; importing this
module makes it parse Namespace paths as kube-apiserver does (`_parse_namespace_paths`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import yaml
from kmock._internal import parsing

ROOT = Path(__file__).resolve().parents[2]

# One term of a selector, e.g. `a=b`, `a!=b`, `a in (x,y)`, `a notin (x)`, `a`, `!a`.
_TERM = re.compile(
    r"(?P<neg>!?)(?P<key>[A-Za-z0-9_./-]+)"
    r"(?:(?P<op>==|=|!=)(?P<value>[^,]*)|\s+(?P<set>in|notin)\s*\((?P<items>[^)]*)\))?"
)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _terms(selector: str) -> list[str]:
    """Split on the commas that are not inside `( )`."""
    return [t.strip() for t in re.findall(r"(?:[^,(]|\([^)]*\))+", selector) if t.strip()]


def _selected(selector: str, value_of: Callable[[str], str | None], *, label: bool) -> bool:
    for term in _terms(selector):
        m = _TERM.fullmatch(term)
        if m is None:
            raise kmock.KubernetesError(400, "BadRequest", f"unable to parse selector {term!r}")
        key, op, value = m["key"], m["op"], m["value"]
        items = {i.strip() for i in (m["items"] or "").split(",")} - {""}
        if label:
            for v in [value or "", *items]:
                if len(v) > 63 or not _LABEL_VALUE.match(v):
                    raise kmock.KubernetesError(
                        400, "BadRequest", f"invalid label value {v!r} in selector {selector!r}"
                    )
        actual = value_of(key)
        if op in ("=", "=="):
            ok = actual == value
        elif op == "!=":
            ok = actual != value
        elif m["set"] == "in":
            ok = actual in items
        elif m["set"] == "notin":
            ok = actual not in items
        else:
            ok = (actual is None) == bool(m["neg"])
        if not ok:
            return False
    return True


def _field(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    # The apiserver compares field values as strings; a missing field is "".
    return "" if value is None else str(value)


def _matches(obj: dict[str, Any], params: Mapping[str, str]) -> bool:
    obj_labels: dict[str, str] = (obj.get("metadata") or {}).get("labels") or {}
    return _selected(params.get("labelSelector", ""), obj_labels.get, label=True) and _selected(
        params.get("fieldSelector", ""), partial(_field, obj), label=False
    )


class ApiServerEmulator(kmock.KubernetesEmulator):
    """KMock's emulator, made to behave like kube-apiserver where kubetune relies on it.

    KMock 0.8 differs in two ways (see "The stock emulator" below):

    - lists ignore `labelSelector` and `fieldSelector` and return every object of the
      resource (and namespace); here both are applied, with the apiserver's operators
      (`=`, `==`, `!=`, `in`, `notin`, exists, `!`; fields: `=`, `==`, `!=`), and a
      malformed selector or label value is a 400 as on a real server;
    - error Statuses go out as `application/json; charset=utf-8`, and lightkube raises
      `ApiError` only for the exact `application/json` that kube-apiserver sends, so a
      409 or 404 would reach kubetune as a bare `httpx2.HTTPStatusError`; here errors
      carry the apiserver's content type.

    Watch streams are not filtered: nothing in kubetune watches with a selector.
    """

    async def _serve_list(self, request: kmock.Request) -> Any:
        payload: dict[str, Any] = await super()._serve_list(request)  # type: ignore[assignment]
        payload["items"] = [obj for obj in payload["items"] if _matches(obj, request.params)]
        return payload

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        response = await super()._render_error(exc)
        assert isinstance(response, aiohttp.web.Response)
        return aiohttp.web.Response(
            body=response.body, status=response.status, content_type="application/json"
        )


_stock_parse_path = parsing.parse_path


def _parse_namespace_paths(path: str) -> parsing.ParsedPath:
    """`/api/v1/namespaces[/NAME[/status|finalize]]` is the cluster-scoped Namespace
    resource; every other path as KMock parses it."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
        len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))
    ):
        rest = parts[3:]
        return parsing.ParsedPath(
            group="",
            version="v1",
            plural="namespaces",
            name=rest[0] if rest else None,
            subresource=rest[1] if len(rest) > 1 else None,
        )
    return _stock_parse_path(path)


parsing.parse_path = _parse_namespace_paths


def register_crds(emulator: kmock.KubernetesEmulator) -> None:
    """Serve kubetune's CRDs (crds/*.yaml) as resources of the emulator."""
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        spec, names = crd["spec"], crd["spec"]["names"]
        for version in spec["versions"]:
            emulator.resources[f"{spec['group']}/{version['name']}/{names['plural']}"] = (
                kmock.ResourceInfo(
                    kind=names["kind"],
                    singular=names["singular"],
                    namespaced=spec["scope"] == "Namespaced",
                    shortnames=names.get("shortNames", []),
                    categories=names.get("categories", []),
                    subresources=version.get("subresources", {}).keys(),
                    verbs=["create", "delete", "get", "list", "patch", "update", "watch"],
                )
            )


def declare_resources(emulator: kmock.KubernetesEmulator) -> None:
    """Built-in resources (pods, nodes, batch/v1 jobs, events, ...) for discovery, plus ours."""
    emulator.resources.load_bundled()
    register_crds(emulator)
