"""Calls to the Hugging Face hub (models, tokenizers, datasets), with their failures sorted.

A hub call fails in one of three ways, and each ends the run differently:

- the hub refused access (HTTP 401/403: a gated or private repository, a missing or invalid
  token) or has no such thing (404: repository, revision or file): retrying cannot help, so
  `ConfigError` (exit 2) with the URI and what to fix;
- the hub or the network is unwell (HTTP 429/5xx, timeouts, refused or reset connections):
  `hub_call` retries a few times with backoff, then raises `HubUnavailable` (exit 1, which the
  batch Job restarts);
- anything else is not the hub's doing and goes up unchanged.

transformers and datasets wrap hub errors in their own (`raise OSError(...) from e`), so the
classification walks the chain of causes.
"""

from __future__ import annotations

import logging
import time
import urllib.error
from collections.abc import Callable
from typing import Any, TypeVar

from kubetune_trainer.errors import ConfigError, HubUnavailable, TrainerExit

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_DELAYS_S: tuple[float, ...] = (5.0, 15.0, 45.0)
"""Waits before the 2nd, 3rd and 4th try of a call that failed transiently: a hub call, an
S3 object or an https download of the stage-in step (botocore retries single requests
inside each try)."""

AUTH, NOT_FOUND, TRANSIENT = "auth", "not-found", "transient"
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in seen and len(seen) < 16:
        seen.append(cur)
        cur = cur.__cause__
    return seen


def _status(e: BaseException) -> int | None:
    if isinstance(e, urllib.error.HTTPError):
        return int(e.code)
    response = getattr(e, "response", None)
    code = getattr(response, "status_code", None)
    return int(code) if isinstance(code, int) else None


def classify(e: BaseException) -> tuple[str, BaseException] | None:
    """(AUTH | NOT_FOUND | TRANSIENT, the hub error found) or None: not a hub failure."""
    try:
        from huggingface_hub import errors as hf
    except ImportError:  # pragma: no cover - the trainer image always has it
        hf = None  # type: ignore[assignment]
    # The base error of the hub client's HTTP library (httpx or its successor), which its
    # errors module re-exports: a status-less one is a transport failure.
    transport: Any = getattr(hf, "HTTPError", None) if hf is not None else None
    for err in _chain(e):
        if hf is not None:
            if isinstance(err, hf.GatedRepoError):
                return AUTH, err
            if isinstance(err, hf.RepositoryNotFoundError | hf.RevisionNotFoundError):
                return NOT_FOUND, err
            if isinstance(err, hf.RemoteEntryNotFoundError | hf.DisabledRepoError):
                return NOT_FOUND, err
            if isinstance(err, hf.OfflineModeIsEnabled):
                return None  # HF_HUB_OFFLINE is set: a choice, not an outage
        status = _status(err)
        if status in (401, 403):
            return AUTH, err
        if status == 404:
            return NOT_FOUND, err
        if status in _TRANSIENT_STATUS or (status is not None and status >= 500):
            return TRANSIENT, err
        if status is not None:
            return None
        if transport is not None and isinstance(err, transport):
            return TRANSIENT, err  # a transport error: timeout, connect, read, protocol
        if isinstance(err, ConnectionError | TimeoutError | urllib.error.URLError):
            return TRANSIENT, err
    # The hub client's "not in the cache and the hub could not be reached" has no cause when
    # it gave up on its own; it says so, and nothing else raises it on a download.
    if hf is not None and isinstance(e, hf.LocalEntryNotFoundError):
        return TRANSIENT, e
    return None


def _first_line(e: BaseException, limit: int = 240) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    return f"{type(e).__name__}: {text[:limit]}"


def _config_error(
    kind: str,
    err: BaseException,
    *,
    what: str,
    uri: str,
    field: str,
    revision: str | None,
    token_env: str | None,
) -> ConfigError:
    status = _status(err)
    http = f"HTTP {status}" if status else type(err).__name__
    if kind == AUTH:
        if token_env:
            fix = (
                "the token in the Secret of model.tokenSecretRef is invalid or cannot read this "
                "repository; for a gated repository, accept its terms on huggingface.co with "
                "the token's account, or put a token that has access in the Secret"
            )
        else:
            fix = (
                "put a hub token with access to it in a Secret and name it in "
                "model.tokenSecretRef (for a gated repository, accept its terms on "
                "huggingface.co first)"
            )
        return ConfigError(
            f"{what} {uri}: the hub refused access ({http}: gated or private, and no valid "
            f"token for it). To fix: {fix}"
        )
    from huggingface_hub import errors as hf

    if isinstance(err, hf.RevisionNotFoundError):
        return ConfigError(
            f"{what} {uri}: revision {revision!r} does not exist ({http}). To fix: set "
            f"{field.rsplit('.', 1)[0]}.revision to a branch, tag or commit of the repository"
        )
    if isinstance(err, hf.RemoteEntryNotFoundError):
        return ConfigError(
            f"{what} {uri}: a file it needs is not in the repository"
            f"{f' at revision {revision}' if revision else ''} ({http}: "
            f"{_first_line(err, 160)}). To fix: check {field} and the revision"
        )
    private = "" if token_env else ", or it is private and no token was given"
    return ConfigError(
        f"{what} {uri}: no such repository on the hub{private} ({http}). To fix: check "
        f"{field} (the name, e.g. org/name)"
        + ("" if token_env else "; for a private repository, set model.tokenSecretRef")
    )


def hub_call(
    fn: Callable[[], T],
    *,
    what: str,
    uri: str,
    field: str,
    revision: str | None = None,
    token_env: str | None = None,
) -> T:
    """`fn()`, retried on transient hub failures; permanent ones become `ConfigError`.

    `what` names the thing for messages ("model", "tokenizer", "dataset"), `uri` where it
    is, `field` the spec field that names it (for "To fix:").
    """

    def verdict(e: BaseException) -> ConfigError | str | None:
        found = classify(e)
        if found is None:
            return None
        kind, err = found
        if kind != TRANSIENT:
            return _config_error(
                kind, err, what=what, uri=uri, field=field, revision=revision, token_env=token_env
            )
        return _first_line(err)

    def gave_up(tries: int, detail: str) -> TrainerExit:
        return HubUnavailable(
            f"{what} {uri}: the hub could not be reached after {tries} tries ({detail}); the "
            "pod is restarted and tries again"
        )

    return retrying(fn, verdict, what=what, uri=uri, gave_up=gave_up)


def retrying(
    fn: Callable[[], T],
    classify: Callable[[BaseException], ConfigError | str | None],
    *,
    what: str,
    uri: str,
    gave_up: Callable[[int, str], TrainerExit],
) -> T:
    """`fn()`, retried after RETRY_DELAYS_S when `classify` calls the failure transient (it
    says what happened); a permanent one raises the ConfigError `classify` made; one it does
    not know (None) goes up unchanged; the last transient one raises `gave_up(tries, what
    happened)`, an exit that restarts the pod."""
    tries = len(RETRY_DELAYS_S) + 1
    for attempt in range(1, tries + 1):
        try:
            return fn()
        except TrainerExit:
            raise  # already sorted
        except Exception as e:
            verdict = classify(e)
            if verdict is None:
                raise
            if isinstance(verdict, ConfigError):
                raise verdict from e
            if attempt == tries:
                raise gave_up(tries, verdict) from e
            delay = RETRY_DELAYS_S[attempt - 1]
            log.warning(
                "%s %s: %s; try %d of %d in %.0fs", what, uri, verdict, attempt + 1, tries, delay
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
