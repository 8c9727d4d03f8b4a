"""Where a model's architecture comes from: the built-in table, a file, or the hub.

This is the edge of planning: the only product module that reads files or the network to
size a job. :mod:`kubetune.planning.arch` turns a parsed ``config.json`` into a
:class:`~kubetune.planning.arch.ModelArch` and knows the built-in table; this module finds the
``config.json`` to parse: a local file or directory (the CLI), a mounted claim (``pvc_root``),
or ``huggingface.co`` when network access is allowed. The reconcile logic never calls it
directly: the handlers pass :func:`load_arch` in, so the pure core stays free of I/O.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from kubetune.planning.arch import (
    FIX_UNKNOWN,
    ArchitectureError,
    ModelArch,
    arch_from_hf_config,
    find_known_model,
    known_in_volume_path,
    suggestions,
)
from kubetune_trainer.uris import Form, Uri, UriError, parse_uri, scheme_form, split_hub_reference

__all__ = ["HF_ENDPOINT", "MAX_CONFIG_BYTES", "load_arch", "load_config_file"]

HF_ENDPOINT = "https://huggingface.co"
_MAX_CONFIG_BYTES = 4 * 1024 * 1024
"""Most bytes read from the hub for one config.json."""

MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""A config.json is a few kilobytes; anything this large is not one."""


def load_config_file(path: str | os.PathLike[str]) -> dict[str, object]:
    """Read a ``config.json`` (or a directory holding one) into a dict."""
    try:
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / "config.json"
        if p.exists() and not p.is_file():
            raise ArchitectureError(
                f"{p} is not a regular file; To fix: point at a config.json or the model "
                "directory containing it."
            )
        with p.open("rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ArchitectureError(
                f"{p} is larger than {MAX_CONFIG_BYTES // 2**20} MiB, so not a config.json; "
                "To fix: point at the model's config.json."
            )
        raw = data.decode("utf-8", errors="replace")
    except FileNotFoundError:
        raise ArchitectureError(
            f"no config.json at {p}; To fix: point at the model directory that contains "
            "config.json, or at the file itself."
        ) from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: `~user` with no such user
        raise ArchitectureError(
            f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}; To fix: check the "
            "path and permissions."
        ) from None
    return _parse_json(raw, str(p))


def _parse_json(raw: str | bytes, source: str) -> dict[str, object]:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArchitectureError(
            f"config.json at {source} is not valid JSON ({exc}); To fix: re-download the file."
        ) from None
    if not isinstance(data, dict):
        raise ArchitectureError(
            f"config.json at {source} is not a JSON object; To fix: re-download the file."
        )
    return {str(k): v for k, v in data.items()}


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*$")
_REVISION = re.compile(r"^[\w.\-/]+$")


def _fetch_hub_config(
    hub_id: str, revision: str, timeout_s: float, token: str | None
) -> dict[str, object]:
    if not _HUB_ID.match(hub_id):
        raise ArchitectureError(
            f"{hub_id!r} is not a Hugging Face model id (expected org/name); {FIX_UNKNOWN}"
        )
    if not _REVISION.match(revision) or ".." in revision:
        raise ArchitectureError(
            f"revision {revision!r} of {hub_id} is not a valid git revision; "
            "To fix: use a branch, tag or commit hash."
        )
    url = f"{HF_ENDPOINT}/{hub_id}/resolve/{revision}/config.json"
    headers = {"User-Agent": "kubetune", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body: bytes = response.read(_MAX_CONFIG_BYTES + 1)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            hint = (
                "the model is gated or private. To fix: accept its licence on the hub and give "
                "the job a token (spec.model.tokenSecretRef), or set spec.model.architecture to "
                "a known model id with the same architecture."
            )
        elif exc.code == 404:
            hint = f"no such model or revision. {FIX_UNKNOWN}"
        else:
            hint = f"the hub answered HTTP {exc.code}. {FIX_UNKNOWN}"
        raise ArchitectureError(f"cannot fetch {url}: {hint}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ArchitectureError(
            f"cannot fetch {url} within {timeout_s:g}s ({reason}); {FIX_UNKNOWN}"
        ) from None
    if len(body) > _MAX_CONFIG_BYTES:
        raise ArchitectureError(
            f"{url} is larger than {_MAX_CONFIG_BYTES} bytes; To fix: pass --config with a "
            "local copy of config.json."
        )
    return _parse_json(body, url)


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or model.endswith(".json")


def _uri(text: str) -> Uri | None:
    """`text` parsed where its scheme is a volume's or a local file's (in any case); None for
    anything else (an id, a path, a hub URL). `gs://`, which nothing fetches, is refused."""
    try:
        if scheme_form(text) not in (Form.PVC, Form.S3, Form.FILE):
            return None
        return parse_uri(text, field="the model", any_case=True)
    except UriError as exc:
        raise ArchitectureError(str(exc)) from None


def _from_volume_uri(model: str, uri: Uri, pvc_root: str | os.PathLike[str] | None) -> ModelArch:
    if uri.form is Form.PVC and uri.claim is not None and pvc_root is not None:
        candidate = Path(pvc_root) / uri.claim / uri.path
        if (candidate / "config.json").is_file() or (
            candidate.is_file() and candidate.suffix == ".json"
        ):
            cfg = load_config_file(candidate)
            return arch_from_hf_config(cfg, model, source=str(candidate))
    # The path often ends in the model's name (pvc://models/Llama-3.1-8B): try the table.
    known = known_in_volume_path(uri.path, model)
    if known is not None:
        return known
    raise ArchitectureError(
        f"cannot read the architecture of {model} at plan time: the operator does not mount "
        f"{uri.form.prefix} volumes. To fix: set spec.model.architecture to a known model id "
        "with the same architecture (e.g. `meta-llama/Llama-3.1-8B`), or name the model "
        "directory after a known model id."
    )


def load_arch(
    model: str,
    *,
    allow_network: bool = False,
    timeout_s: float = 5.0,
    revision: str | None = None,
    token: str | None = None,
    pvc_root: str | os.PathLike[str] | None = None,
    local_files: bool = True,
) -> ModelArch:
    """Resolve ``model`` to an architecture.

    ``model`` may be a built-in id (case-insensitive, with or without the org prefix, e.g.
    ``meta-llama/Llama-3.1-8B`` or ``llama-3.1-8b``), ``hf://org/name[@revision]``, a local
    ``config.json`` or a directory containing one, or ``pvc://claim/path`` / ``s3://...``
    (``gs://`` is refused with what to use instead: nothing fetches from it).  A
    hub id that is not in the table is fetched from the hub only when ``allow_network`` is set.
    ``pvc_root`` is a directory where claims are mounted as ``<pvc_root>/<claim>``.
    ``local_files=False`` refuses local paths: the operator plans jobs whose paths exist in
    the trainer's pods, not on the operator's own filesystem.
    """
    text = model.strip()
    if not text:
        raise ArchitectureError(f"no model given. {FIX_UNKNOWN}")

    uri = _uri(text)
    if uri is not None and uri.form in (Form.PVC, Form.S3):
        return _from_volume_uri(text, uri, pvc_root)

    local = (uri is not None and uri.form is Form.FILE) or _looks_like_path(text)
    if local and not local_files:
        raise ArchitectureError(
            f"{text[:200]!r} is a path inside the trainer's pods, which the operator cannot "
            "read at plan time. To fix: set spec.model.architecture to a known model id "
            "(`kubetune estimate --list-models`) with the same architecture."
        )
    if uri is not None and uri.form is Form.FILE:
        return _from_path(uri.path, text)
    if _looks_like_path(text) or (
        local_files and os.path.exists(text) and find_known_model(text) is None
    ):
        return _from_path(text, text)

    hub_id, rev_in_id = split_hub_reference(text)

    arch = find_known_model(hub_id)
    if arch is not None:
        return arch

    if not allow_network:
        raise ArchitectureError(
            f"unknown model {model!r}: it is not in the built-in table and fetching its "
            f"config.json from the hub is disabled.{suggestions(hub_id)} {FIX_UNKNOWN}"
        )
    cfg = _fetch_hub_config(hub_id, revision or rev_in_id or "main", timeout_s, token)
    return arch_from_hf_config(cfg, hub_id, source=f"{HF_ENDPOINT}/{hub_id}")


def _from_path(path: str, name: str) -> ModelArch:
    try:
        p = Path(path).expanduser()
        exists = p.exists()
    except (OSError, RuntimeError) as exc:  # a name too long, `~user` with no such user
        raise ArchitectureError(
            f"cannot use {path[:80]!r} as a model path: {exc}; To fix: point at a config.json "
            "or the model directory containing it."
        ) from None
    if not exists:
        raise ArchitectureError(
            f"{path} does not exist; To fix: point at a config.json or the model directory "
            "containing it."
        )
    cfg = load_config_file(p)
    source = str(p / "config.json") if p.is_dir() else str(p)
    return arch_from_hf_config(cfg, _display_from_path(p, cfg) or name, source=source)


def _display_from_path(p: Path, cfg: Mapping[str, object]) -> str:
    declared = cfg.get("_name_or_path")
    if isinstance(declared, str) and declared and not declared.startswith("/"):
        return declared
    directory = p if p.is_dir() else p.parent
    return directory.name
