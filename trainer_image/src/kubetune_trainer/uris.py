"""The URIs a FineTuneJob names its model, data and output with, defined once.

Each form is one regular expression: the CRD's `pattern`s are composed of them
(`uri_pattern`), and `parse_uri` accepts exactly what they match before it splits the text
into a `Uri`. So the API server, the operator and the trainer cannot disagree on what a URI
is, and no second parse creeps back (tests/unit/test_uris.py scans the product for one).

The forms, and what `Uri` holds of each (`path` is what follows the claim, bucket or host):

- `pvc://<claim>[/<path>]`: `claim`; `path` in the claim, without surrounding `/`.
- `s3://<bucket>[/<key or prefix>]`: `bucket`; `path`, the key or prefix without leading
  `/`, taken literally (`?` and `#` belong to it, as the AWS CLI reads them).
- `hf://<org>/<name>[@<revision>]`: `hub_id`, `revision`; `path` as written, without
  surrounding `/`.
- `<org>/<name>` or `<name>`, a bare hub id: `hub_id` (and `path`).
- `https://<host>[/<path>][?<query>][#<fragment>]`: `host`, `path`, `query`, `fragment`.
- `http://...`: the same; the stage-in fetcher reads it (a mirror, a test server), the API
  admits only `https`.
- `ftj://<name>`: `job`, a FineTuneJob of the same namespace whose whole model this one trains.
- `/<absolute path>` inside the trainer's pods: `path`.
- `file://<path>`: a local config.json for `kubetune estimate`, never a job's: `path`.

`gs://` is recognised only to be refused: nothing fetches from Google Cloud Storage.

Regular expressions here are written for both Go's RE2 (the API server) and Python's `re`
(pydantic, this module): no `\\s`, `\\S` or `\\w`, whose meaning differs between them, no
look-arounds. Standard library only and no I/O: the operator's pure core imports this module,
the one module of the trainer's package besides its contract that it may import (pyproject's
`trainer-contract-only`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

_SPACE = r"\t\n\f\r "
NOT_SPACE = rf"[^{_SPACE}]"
"""Not ASCII whitespace, spelled out: RE2's `\\S` excludes ASCII whitespace only, Python's any
Unicode whitespace."""
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_HUB_CHAR = r"[A-Za-z0-9_.-]"
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


class Form(StrEnum):
    """How a URI is written: with one of kubetune's schemes, or as a bare hub id or path."""

    PVC = "pvc"
    S3 = "s3"
    HF = "hf"
    HUB = "hub"
    HTTPS = "https"
    HTTP = "http"
    FTJ = "ftj"
    PATH = "path"
    FILE = "file"

    @property
    def prefix(self) -> str:
        """`pvc://` and so on; empty for a bare hub id or path."""
        return "" if self in (Form.HUB, Form.PATH) else f"{self.value}://"


@dataclass(frozen=True)
class _Grammar:
    regex: str
    shape: str
    """How the form is written, for messages."""
    rule: str
    """What its text must hold, for messages."""


_GRAMMAR: dict[Form, _Grammar] = {
    Form.PVC: _Grammar(
        rf"pvc://[^/{_SPACE}]+(/{NOT_SPACE}*)?",
        "pvc://<claim>/<path>",
        "a claim's name, then the path in it",
    ),
    Form.S3: _Grammar(
        rf"s3://[^/{_SPACE}]+(/{NOT_SPACE}*)?",
        "s3://<bucket>/<key or prefix>",
        "a bucket's name, then the key or prefix",
    ),
    Form.HF: _Grammar(
        rf"hf:///*[^/@{_SPACE}]{NOT_SPACE}*",
        "hf://<org>/<name>[@<revision>]",
        "a hub id, then @<revision> to pin one",
    ),
    Form.HUB: _Grammar(
        rf"[A-Za-z0-9]{_HUB_CHAR}*(/{_HUB_CHAR}+)?",
        "<org>/<name>",
        "a hub id: letters, digits, '_', '.' and '-', with at most one '/' (a revision goes "
        "in hf://<org>/<name>@<revision> or the revision field)",
    ),
    Form.HTTPS: _Grammar(
        rf"https://[^/?#{_SPACE}]+([/?#]{NOT_SPACE}*)?",
        "https://<host>/<path>",
        "a host, then the path",
    ),
    Form.HTTP: _Grammar(
        rf"http://[^/?#{_SPACE}]+([/?#]{NOT_SPACE}*)?",
        "http://<host>/<path>",
        "a host, then the path",
    ),
    Form.FTJ: _Grammar(
        rf"ftj://{_DNS_SUBDOMAIN}",
        "ftj://<name>",
        "the name of a FineTuneJob of the same namespace (lowercase letters, digits, '-' and "
        "'.'), nothing after it",
    ),
    Form.PATH: _Grammar(rf"/{NOT_SPACE}*", "/<path>", "an absolute path"),
    Form.FILE: _Grammar(r"file://.*", "file://<path>", "a local file's path"),
}

_SCHEMES = {form.value: form for form in Form if form.prefix}
_REFUSED = {
    "gs": "Google Cloud Storage URIs are not supported: nothing in kubetune fetches from it. "
    "To fix: use s3:// (GCS offers an S3-compatible XML API: set spec.s3.endpoint to "
    "https://storage.googleapis.com and put HMAC keys in the Secret spec.s3.credentialsSecret "
    "names) or copy the files to a volume and use pvc://"
}

MODEL_FORMS = (Form.HF, Form.PVC, Form.S3, Form.FTJ, Form.HUB, Form.PATH)
"""spec.model.uri: also another FineTuneJob's whole model (`ftj://<name>`)."""
DATASET_FORMS = (Form.HF, Form.PVC, Form.S3, Form.HTTPS, Form.HUB, Form.PATH)
"""spec.dataset.uri: also a file served over https (fetched by the stage-in step)."""
OUTPUT_FORMS = (Form.HF, Form.PVC, Form.S3, Form.HUB, Form.PATH)
"""spec.output.uri: `pvc://` and `s3://` say where the output goes. A hub id, `hf://` and a
path have always been admitted and mean what an unset URI means (the checkpoint volume's
`output/`): nothing writes to the hub or to a path of the pods."""
ALL_FORMS = tuple(Form)


class UriError(ValueError):
    """A text that is not a URI of the forms asked for; the message says what is wrong and
    ends with "To fix:"."""


@dataclass(frozen=True)
class Uri:
    """A parsed URI. `path` is what follows the claim, bucket or host (see the module's
    table); the other fields are set only for the forms that have them."""

    form: Form
    text: str
    """As written (with its scheme in lowercase, where `parse_uri` was given any case)."""
    path: str = ""
    claim: str | None = None
    bucket: str | None = None
    host: str | None = None
    query: str = ""
    fragment: str = ""
    hub_id: str | None = None
    revision: str | None = None
    job: str | None = None

    @property
    def is_hub(self) -> bool:
        """A model or dataset on the hub (`hf://` or a bare id)."""
        return self.form in (Form.HF, Form.HUB)


def uri_pattern(forms: Iterable[Form]) -> str:
    """The anchored regular expression (RE2 and Python) that matches the URIs of `forms`:
    the CRD's `pattern` for a field that takes them."""
    return "^(" + "|".join(_GRAMMAR[form].regex for form in forms) + ")$"


def parse_uri(
    text: str,
    forms: Iterable[Form] = ALL_FORMS,
    *,
    field: str = "URI",
    any_case: bool = False,
) -> Uri:
    """`text` as one of `forms`, or a UriError that names `field`. `any_case` takes a scheme
    in any case (the command line's inputs); the API admits lowercase schemes only."""
    return _parse(text, tuple(forms), field, any_case)


@lru_cache(maxsize=1024)
def _parse(text: str, forms: tuple[Form, ...], field: str, any_case: bool) -> Uri:
    form, text = _form_of(text, field, any_case)
    if form not in forms:
        raise UriError(
            f"{field} {text[:200]!r}: {_named(form)} {_cannot(field)}. To fix: use "
            f"{_choices(forms)}"
        )
    grammar = _GRAMMAR[form]
    if not re.fullmatch(grammar.regex, text):
        spaced = re.search(rf"[{_SPACE}]", text) is not None
        why = "a URI holds no spaces, tabs or line breaks" if spaced else grammar.rule
        raise UriError(
            f"{field} {text[:200]!r} is not a {grammar.shape} URI: {why}. To fix: write it as "
            f"{grammar.shape}"
        )
    return _split(form, text)


def scheme_form(text: str) -> Form | None:
    """The form the scheme of `text` names, in any case, the rest not checked; None for a text
    without a scheme or with one kubetune does not know. A refused scheme (`gs://`) raises
    its UriError."""
    match = _SCHEME.match(text)
    if match is None:
        return None
    scheme = match.group(1).lower()
    if scheme in _REFUSED:
        raise UriError(f"{text[:200]!r}: {_REFUSED[scheme]}")
    return _SCHEMES.get(scheme)


def _form_of(text: str, field: str, any_case: bool) -> tuple[Form, str]:
    """The form `text` is written in (by its scheme, else bare), and the text with its scheme
    in lowercase where any case is taken."""
    match = _SCHEME.match(text)
    if match is None:
        return (Form.PATH if text.startswith("/") else Form.HUB), text
    scheme = match.group(1)
    lowered = scheme.lower()
    if lowered in _REFUSED:
        raise UriError(f"{field} {text[:200]!r}: {_REFUSED[lowered]}")
    if lowered != scheme and lowered in _SCHEMES:
        if not any_case:
            raise UriError(
                f"{field} {text[:200]!r}: the scheme is written in uppercase. To fix: write "
                f"{lowered}://"
            )
        scheme, text = lowered, lowered + text[len(lowered) :]
    if scheme not in _SCHEMES:
        raise UriError(
            f"{field} {text[:200]!r}: kubetune reads no {scheme}:// URIs. To fix: use one of "
            f"{', '.join(f'{s}://' for s in _SCHEMES)}, a hub id or an absolute path"
        )
    return _SCHEMES[scheme], text


def _split(form: Form, text: str) -> Uri:
    rest = text[len(form.prefix) :]
    if form in (Form.PVC, Form.S3):
        name, _, path = rest.partition("/")
        if form is Form.PVC:
            return Uri(form, text, path=path.strip("/"), claim=name)
        return Uri(form, text, path=path.lstrip("/"), bucket=name)
    if form in (Form.HF, Form.HUB):
        reference = rest.strip("/")
        hub_id, revision = _split_revision(reference)
        return Uri(form, text, path=reference, hub_id=hub_id, revision=revision)
    if form in (Form.HTTPS, Form.HTTP):
        host_end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
        host, tail = rest[:host_end], rest[host_end:]
        tail, _, fragment = tail.partition("#")
        path, _, query = tail.partition("?")
        return Uri(form, text, path=path, host=host, query=query, fragment=fragment)
    if form is Form.FTJ:
        return Uri(form, text, job=rest)
    return Uri(form, text, path=rest)  # PATH (rest is the text) and FILE


def _split_revision(reference: str) -> tuple[str, str | None]:
    hub_id, _, revision = reference.partition("@")
    return hub_id, revision or None


_HUB_PREFIXES = ("hf://", "https://huggingface.co/", "http://huggingface.co/")


def split_hub_reference(model: str) -> tuple[str, str | None]:
    """``org/name`` and the revision of a hub reference as people type it on the command line:
    ``hf://org/name@rev``, a huggingface.co URL, or an id, any case, spaces around. Not
    validated: the hub id checks come after (`kubetune.sources`)."""
    hub_id = model.strip()
    lowered = hub_id.lower()
    for prefix in _HUB_PREFIXES:
        if lowered.startswith(prefix):
            hub_id = hub_id[len(prefix) :]
            break
    return _split_revision(hub_id.strip("/"))


def pvc_uri(claim: str, path: str) -> str:
    """The `pvc://` URI of `path` on `claim`."""
    return f"{Form.PVC.prefix}{claim}/{path.strip('/')}"


def _named(form: Form) -> str:
    return {Form.HUB: "a hub id", Form.PATH: "a path"}.get(form, f"a {form.prefix} URI")


def _cannot(field: str) -> str:
    return f"is not what {field} takes" if field != "URI" else "is not taken here"


def _choices(forms: Iterable[Form]) -> str:
    return ", ".join(_GRAMMAR[form].shape for form in forms)
