"""How each kind of setting is read from its environment variable, and what a bad value says.

Every reader takes the environment, the variable's name and the default of the field it sets
(settings/table.py pairs them), so that its "to fix:" message names the variable and what
unsetting it gives. An unset or empty variable gives the default. A bad value raises
ValueError: the operator stops at start rather than run with a setting it cannot read.

The leader election's variables (`leader_flag`, `lease_seconds`) keep their own wording,
"To fix:" as a sentence of its own, as `LeaderSettings.validate()` words its errors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any, get_args

from kubetune.api.units import quantity_value
from kubetune.api.v1alpha1 import Objective

Parser = Callable[[Mapping[str, str], str, Any], Any]
"""`(environment, variable, default) -> value`."""

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _raw(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    return None if raw is None or raw == "" else raw


def text(env: Mapping[str, str], name: str, default: Any) -> Any:
    """The value as it is."""
    return _raw(env, name) or default


def comma_list(env: Mapping[str, str], name: str, default: Any) -> tuple[str, ...]:
    """Comma-separated items, blanks dropped."""
    return tuple(filter(None, (p.strip() for p in env.get(name, "").split(","))))


def or_pod_namespace(env: Mapping[str, str], name: str, default: Any) -> str | None:
    """The value, else the pod's own namespace (POD_NAMESPACE, from the downward API)."""
    return _raw(env, name) or env.get("POD_NAMESPACE") or default


def number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = _raw(env, name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def whole(env: Mapping[str, str], name: str, default: int) -> int:
    """A number, its fraction dropped."""
    return int(number(env, name, default))


def positive(env: Mapping[str, str], name: str, default: float) -> float:
    value = number(env, name, default)
    if value <= 0:
        raise ValueError(
            f"{name}={env.get(name)!r} must be greater than zero; to fix: set a positive "
            f"number, or unset it for {default:g}"
        )
    return value


def whole_positive(env: Mapping[str, str], name: str, default: int) -> int:
    return int(positive(env, name, default))


def port(env: Mapping[str, str], name: str, default: int) -> int:
    """A port number; 0: any free port, below zero: none."""
    raw = _raw(env, name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not a port number; to fix: set a whole number (0: any free "
            f"port, -1: none), or unset it for {default}"
        ) from None


def quantity_amount(raw: str) -> Decimal | None:
    """The number a Kubernetes quantity stands for (`16Gi` → 17179869184), or None when
    `raw` is not one. The one place settings read quantities."""
    try:
        return quantity_value(raw)
    except ValueError:
        return None


def quantity(env: Mapping[str, str], name: str, default: str) -> str:
    """A positive Kubernetes quantity, as written (`500m`, `16Gi`)."""
    raw = _raw(env, name)
    if raw is None:
        return default
    amount = quantity_amount(raw)
    if amount is None or amount <= 0:
        raise ValueError(
            f"{name}={raw!r} is not a positive Kubernetes quantity; to fix: set it to a "
            f"number with an optional unit, e.g. {default!r}, or unset it for {default}"
        )
    return raw


def cache_bytes(env: Mapping[str, str], name: str, size: str) -> int:
    """A quantity in bytes; unset: 90% of `size` (the cache's, its default)."""
    raw = _raw(env, name)
    if raw is None:
        return int(_amount(size) * Decimal("0.9"))
    return int(_amount(quantity(env, name, size)))


def _amount(checked: str) -> Decimal:
    amount = quantity_amount(checked)
    assert amount is not None, f"{checked!r} was checked as a quantity"
    return amount


def boolean(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _raw(env, name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(
        f"{name}={raw!r} is not true or false; to fix: set true or false, or unset it for "
        f"{str(default).lower()}"
    )


def loose_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """True for true, yes, on or 1; anything else is false."""
    return env.get(name, "").lower() in _TRUE


def objective(env: Mapping[str, str], name: str, default: Objective) -> Objective:
    raw = _raw(env, name)
    if raw is None:
        return default
    allowed: tuple[Objective, ...] = get_args(Objective)
    for value in allowed:
        if raw == value:
            return value
    raise ValueError(
        f"{name}={raw!r}: the default objective must be one of {', '.join(allowed)}; "
        f"to fix: set {name} to one of them, or unset it for {default}"
    )


def url(env: Mapping[str, str], name: str, default: str | None) -> str | None:
    """An http(s) URL, without a trailing slash."""
    raw = _raw(env, name)
    if raw is None:
        return default
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", raw):
        raise ValueError(
            f"{name}={raw!r} is not an http(s) URL; to fix: set it like "
            "'https://hub.example.internal', or unset it for huggingface.co"
        )
    return raw.rstrip("/")


# ---------------------------------------------------------------------- JSON values


def _json(env: Mapping[str, str], name: str, expected: type, example: str) -> Any:
    raw = _raw(env, name)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(
            f"{name}={raw!r} is not JSON ({exc}); to fix: set it to JSON such as {example}"
        ) from None
    if not isinstance(value, expected):
        raise ValueError(
            f"{name}={raw!r} is not a JSON {expected.__name__}; to fix: set it to JSON such "
            f"as {example}"
        )
    return value


def string_map(env: Mapping[str, str], name: str, default: Any) -> tuple[tuple[str, str], ...]:
    """A JSON object of strings (labels), as sorted pairs."""
    value = _json(env, name, dict, '{"app.kubernetes.io/name": "kubetune"}') or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(
            f"{name}={env.get(name)!r}: label keys and values must be strings; to fix: quote "
            "every value"
        )
    return tuple(sorted(value.items()))


_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def tolerations(env: Mapping[str, str], name: str, default: Any) -> tuple[dict[str, Any], ...]:
    example = '[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]'
    value = _json(env, name, list, example) or []
    for item in value:
        if not isinstance(item, dict) or not item or set(item) - _TOLERATION_KEYS:
            raise ValueError(
                f"{name}: {item!r} is not a toleration; to fix: give each item some of "
                f"{', '.join(sorted(_TOLERATION_KEYS))}, e.g. {example}"
            )
    return tuple(value)


_PEER_KEYS = {"podSelector", "namespaceSelector", "ipBlock"}


def network_peers(
    env: Mapping[str, str], name: str, default: tuple[dict[str, Any], ...]
) -> tuple[dict[str, Any], ...]:
    """A JSON list of NetworkPolicyPeers; `[]`: none, unset: the default."""
    value = _json(env, name, list, '[{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]')
    if value is None:
        return default
    for peer in value:
        if not isinstance(peer, dict) or not peer or set(peer) - _PEER_KEYS:
            raise ValueError(
                f"{name}: {peer!r} is not a NetworkPolicyPeer; to fix: give each item one or "
                "more of podSelector, namespaceSelector (label selectors) or ipBlock"
            )
    return tuple(value)


def volume_source(env: Mapping[str, str], name: str, default: Any) -> dict[str, Any] | None:
    """One pod volume source (`{"csi": {...}}`); `{}` or unset: none."""
    raw = env.get(name) or "{}"
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{name} is not JSON ({exc})") from None
    if value == {}:
        return None
    if not isinstance(value, dict) or len(value) != 1 or "name" in value:
        raise ValueError(
            f"{name}={raw!r} is not one pod volume source; to fix: give one, "
            'e.g. {"csi": {"driver": "nfs.csi.k8s.io", "volumeAttributes": {"server": '
            '"nfs.storage", "share": "/kubetune-cache"}}}, or {} for a claim per namespace'
        )
    return value


# ---------------------------------------------------------------------- leader election


def leader_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={env[name]!r} is not true or false. To fix: set it to true or false")


def lease_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    return _seconds(env, name, default, whole=False)


def whole_lease_seconds(env: Mapping[str, str], name: str, default: int) -> int:
    return int(_seconds(env, name, default, whole=True))


def _seconds(env: Mapping[str, str], name: str, default: float, whole: bool) -> float:
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or (whole and value != int(value)):
        kind = "a whole number of seconds" if whole else "a number of seconds"
        raise ValueError(
            f"{name}={raw!r} is not {kind} above zero. To fix: set it to e.g. {default:g}, "
            f"or unset it for {default:g}"
        )
    return value
