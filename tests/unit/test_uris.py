"""The one URI parser (`kubetune_trainer.uris`): each form and its edges, the CRD's patterns
composed of its forms and accepting exactly what it parses, admission no stricter than before
for URIs that worked, `gs://` refused the same way everywhere, and no second parse of a URI
anywhere else in the product."""

from __future__ import annotations

import ast
import re
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kubetune.api.v1alpha1 import (
    DATASET_URI_PATTERN,
    MODEL_URI_PATTERN,
    URI_PATTERN,
    FineTuneJobSpec,
)
from kubetune.control.build.storage import Location, locate
from kubetune.planning.arch import ArchitectureError
from kubetune.sources import load_arch
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.stagein.fetch import parse_s3
from kubetune_trainer.uris import (
    ALL_FORMS,
    DATASET_FORMS,
    MODEL_FORMS,
    OUTPUT_FORMS,
    Form,
    Uri,
    UriError,
    parse_uri,
    pvc_uri,
    scheme_form,
    split_hub_reference,
    uri_pattern,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"model": MODEL_FORMS, "dataset": DATASET_FORMS, "output": OUTPUT_FORMS}


# --------------------------------------------------------------------------- each form


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pvc://models/llama", Uri(Form.PVC, "pvc://models/llama", path="llama", claim="models")),
        ("pvc://models", Uri(Form.PVC, "pvc://models", claim="models")),
        ("pvc://models/", Uri(Form.PVC, "pvc://models/", claim="models")),
        ("pvc://m/a//b/", Uri(Form.PVC, "pvc://m/a//b/", path="a//b", claim="m")),
        ("s3://bucket", Uri(Form.S3, "s3://bucket", bucket="bucket")),
        ("s3://bucket/", Uri(Form.S3, "s3://bucket/", bucket="bucket")),
        ("s3://b/pre/fix/", Uri(Form.S3, "s3://b/pre/fix/", path="pre/fix/", bucket="b")),
        ("s3://b//key", Uri(Form.S3, "s3://b//key", path="key", bucket="b")),
        ("s3://b/k?v=1#x", Uri(Form.S3, "s3://b/k?v=1#x", path="k?v=1#x", bucket="b")),
        (
            "hf://Qwen/Qwen2.5-7B@v1.0",
            Uri(
                Form.HF,
                "hf://Qwen/Qwen2.5-7B@v1.0",
                path="Qwen/Qwen2.5-7B@v1.0",
                hub_id="Qwen/Qwen2.5-7B",
                revision="v1.0",
            ),
        ),
        ("hf:///org/name/", Uri(Form.HF, "hf:///org/name/", path="org/name", hub_id="org/name")),
        ("hf://org/name@", Uri(Form.HF, "hf://org/name@", path="org/name@", hub_id="org/name")),
        ("org/name", Uri(Form.HUB, "org/name", path="org/name", hub_id="org/name")),
        ("gpt2", Uri(Form.HUB, "gpt2", path="gpt2", hub_id="gpt2")),
        (
            "https://data.example.com:8443/a/train.jsonl?sig=x&t=1#part",
            Uri(
                Form.HTTPS,
                "https://data.example.com:8443/a/train.jsonl?sig=x&t=1#part",
                path="/a/train.jsonl",
                host="data.example.com:8443",
                query="sig=x&t=1",
                fragment="part",
            ),
        ),
        ("https://h?x=1", Uri(Form.HTTPS, "https://h?x=1", host="h", query="x=1")),
        ("https://h", Uri(Form.HTTPS, "https://h", host="h")),
        (
            "http://127.0.0.1:9/d.jsonl",
            Uri(Form.HTTP, "http://127.0.0.1:9/d.jsonl", path="/d.jsonl", host="127.0.0.1:9"),
        ),
        ("ftj://support-sft", Uri(Form.FTJ, "ftj://support-sft", job="support-sft")),
        ("/data/train.jsonl", Uri(Form.PATH, "/data/train.jsonl", path="/data/train.jsonl")),
        ("/", Uri(Form.PATH, "/", path="/")),
        ("file://a b/c.json", Uri(Form.FILE, "file://a b/c.json", path="a b/c.json")),
    ],
)
def test_each_form_parses_into_its_parts(text: str, expected: Uri) -> None:
    assert parse_uri(text) == expected


def test_https_urls_split_as_urllib_splits_them() -> None:
    for url in ["https://h/a/b.jsonl?x=1#f", "https://h?q", "https://h#f/x?y", "https://[::1]:8/x"]:
        ours, theirs = parse_uri(url), urllib.parse.urlsplit(url)
        assert (ours.host, ours.path, ours.query, ours.fragment) == (
            theirs.netloc, theirs.path, theirs.query, theirs.fragment
        )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("pvc://", "is not a pvc://<claim>/<path> URI: a claim's name"),
        ("pvc:///data/x.jsonl", "is not a pvc://<claim>/<path> URI"),
        ("s3:///key", "is not a s3://<bucket>/<key or prefix> URI: a bucket's name"),
        ("s3://", "is not a s3://<bucket>"),
        ("hf://", "is not a hf://<org>/<name>[@<revision>] URI"),
        ("hf:////", "is not a hf://"),
        ("hf://@main", "is not a hf://"),
        ("https:///x.jsonl", "is not a https://<host>/<path> URI: a host"),
        ("https://?x", "is not a https://"),
        ("ftj://", "is not a ftj://<name> URI"),
        ("ftj://Upper", "the name of a FineTuneJob"),
        ("ftj://sft/", "the name of a FineTuneJob"),
        # A path out of the namespace would make the operator read another tenant's job.
        ("ftj://../../other/finetunejobs/x", "the name of a FineTuneJob"),
        ("ftj://..", "the name of a FineTuneJob"),
        ("ftj://a..b", "the name of a FineTuneJob"),
        ("org/name/extra", "is not a <org>/<name> URI: a hub id"),
        ("org/name@main", "hf://<org>/<name>@<revision>"),
        ("./data.jsonl", "is not a <org>/<name> URI"),
        ("", "is not a <org>/<name> URI"),
        ("/data/train .jsonl", "a URI holds no spaces, tabs or line breaks"),
        ("pvc://c/a\tb", "a URI holds no spaces"),
        ("PVC://models/x", "the scheme is written in uppercase. To fix: write pvc://"),
        ("S3://b/k", "To fix: write s3://"),
        ("ftp://host/x", "kubetune reads no ftp:// URIs. To fix: use one of pvc://, s3://"),
        ("gs://bucket/data.jsonl", "Google Cloud Storage URIs are not supported"),
        ("GS://bucket/data.jsonl", "Google Cloud Storage URIs are not supported"),
    ],
)
def test_what_is_not_a_uri_says_what_is_wrong_and_how_to_fix_it(text: str, needle: str) -> None:
    with pytest.raises(UriError) as err:
        parse_uri(text, field="spec.dataset.uri")
    message = str(err.value)
    assert needle in message
    assert "To fix:" in message
    assert message.startswith("spec.dataset.uri ")
    assert isinstance(err.value, ValueError)


def test_a_form_a_field_does_not_take_names_the_ones_it_does() -> None:
    with pytest.raises(UriError, match=r"a https:// URI is not what spec.model.uri takes\. To fix"):
        parse_uri("https://h/m", MODEL_FORMS, field="spec.model.uri")
    with pytest.raises(UriError, match=r"To fix: use .*ftj://<name>"):
        parse_uri("/models/x", (Form.FTJ,), field="spec.model.uri")
    with pytest.raises(UriError, match=r"a path is not what"):
        parse_uri("/x", (Form.S3,), field="destination")


def test_the_command_line_may_write_a_scheme_in_any_case() -> None:
    assert parse_uri("PVC://models/x", any_case=True) == parse_uri("pvc://models/x")
    assert parse_uri("Hf://org/name", any_case=True).hub_id == "org/name"
    with pytest.raises(UriError, match="not supported"):
        parse_uri("Gs://b/x", any_case=True)
    assert scheme_form("S3://b") is Form.S3
    assert scheme_form("meta-llama/Llama-3.1-8B") is None
    assert scheme_form("foo://x") is None
    with pytest.raises(UriError, match="To fix: use s3://"):
        scheme_form("gs://b/x")


def test_hub_references_as_people_type_them() -> None:
    for text in [
        "hf://meta-llama/Llama-3.1-8B@main",
        "HF://meta-llama/Llama-3.1-8B@main",
        "https://huggingface.co/meta-llama/Llama-3.1-8B@main",
        "  http://huggingface.co/meta-llama/Llama-3.1-8B/@main ",
        "meta-llama/Llama-3.1-8B@main",
    ]:
        hub_id, revision = split_hub_reference(text)
        assert hub_id.strip("/") == "meta-llama/Llama-3.1-8B" and revision == "main", text
    assert split_hub_reference("org/name@") == ("org/name", None)
    assert split_hub_reference("llama-3.1-8b") == ("llama-3.1-8b", None)


def test_pvc_uris_are_composed_as_they_parse() -> None:
    uri = pvc_uri("sft-ckpt", "output/merged/")
    assert uri == "pvc://sft-ckpt/output/merged"
    assert (parse_uri(uri).claim, parse_uri(uri).path) == ("sft-ckpt", "output/merged")


def test_is_hub_means_the_hub() -> None:
    hub = {form for form in Form if form in (Form.HF, Form.HUB)}
    examples = {
        Form.PVC: "pvc://c/x", Form.S3: "s3://b/x", Form.HF: "hf://o/n", Form.HUB: "o/n",
        Form.HTTPS: "https://h/x", Form.HTTP: "http://h/x", Form.FTJ: "ftj://sft",
        Form.PATH: "/x", Form.FILE: "file:///x",
    }  # fmt: skip
    assert set(examples) == set(Form)
    assert {form for form, text in examples.items() if parse_uri(text).is_hub} == hub


# --------------------------------------------------------------------------- CRD patterns


def test_the_crd_patterns_are_composed_of_the_parsers_forms() -> None:
    assert uri_pattern(MODEL_FORMS) == MODEL_URI_PATTERN
    assert uri_pattern(DATASET_FORMS) == DATASET_URI_PATTERN
    assert uri_pattern(OUTPUT_FORMS) == URI_PATTERN
    crd = yaml.safe_load((ROOT / "crds/finetunejobs.kubetune.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for field, forms in FIELDS.items():
        assert spec["properties"][field]["properties"]["uri"]["pattern"] == uri_pattern(forms)


def test_the_patterns_stay_within_what_re2_and_python_read_alike() -> None:
    """No `\\s`, `\\S`, `\\w`, `\\d` (whose meaning differs between Go and Python), no
    look-arounds or back-references (which RE2 lacks)."""
    pattern = uri_pattern(ALL_FORMS)
    assert not re.search(r"\\[sSwWdDbB]|\(\?[=!<]|\\[1-9]", pattern)


_INTERESTING = st.text(alphabet="aZ09-_./:@?#%\t é", max_size=14)
_SCHEMED = st.builds(
    lambda scheme, rest: scheme + rest,
    st.sampled_from(["pvc://", "s3://", "hf://", "https://", "http://", "ftj://", "file://",
                     "gs://", "PVC://", "", "/", "//"]),
    _INTERESTING,
)  # fmt: skip


def _parses(text: str, forms: tuple[Form, ...]) -> bool:
    try:
        parse_uri(text, forms)
    except UriError:
        return False
    return True


@pytest.mark.parametrize("field", sorted(FIELDS))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.data())
def test_the_pattern_accepts_exactly_what_the_parser_parses(field: str, data: Any) -> None:
    forms = FIELDS[field]
    pattern = uri_pattern(forms)
    text = data.draw(st.one_of(_SCHEMED, st.from_regex(pattern, fullmatch=True)))
    assert _parses(text, forms) == bool(re.fullmatch(pattern, text)), text


# What the CRD admitted before the parser; `\w` as the apiserver (RE2) reads it: ASCII.
_BEFORE = r"^((hf|pvc|s3)://[^\t\n\f\r ]+|[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?|/[^\t\n\f\r ]*)$"
BEFORE = {
    "output": _BEFORE,
    "dataset": _BEFORE.replace("(hf|pvc|s3)://", "(hf|pvc|s3|https)://"),
    "model": _BEFORE.replace("(hf|pvc|s3)://", "(hf|pvc|s3|ftj)://"),
}
_DNS = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _failed_later(text: str) -> bool:
    """A URI the CRD admitted before that nothing could read: a claim, bucket, host or hub id
    left empty, or a FineTuneJob name no FineTuneJob can have."""
    scheme, _, rest = text.partition("://")
    if scheme in ("pvc", "s3"):
        return rest.partition("/")[0] == ""
    if scheme == "https":
        return re.match(r"[/?#]|$", rest) is not None
    if scheme == "hf":
        return rest.strip("/").partition("@")[0] == ""
    if scheme == "ftj":
        return _DNS.fullmatch(rest) is None
    return False


@pytest.mark.parametrize("field", sorted(FIELDS))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.data())
def test_admission_is_no_stricter_for_uris_that_worked(field: str, data: Any) -> None:
    before = re.compile(BEFORE[field], re.ASCII)
    text = data.draw(st.one_of(st.from_regex(before, fullmatch=True), _SCHEMED))
    if before.fullmatch(text) and not re.fullmatch(uri_pattern(FIELDS[field]), text):
        assert _failed_later(text), text


@pytest.mark.parametrize("field", sorted(FIELDS))
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.data())
def test_admission_is_no_looser(field: str, data: Any) -> None:
    pattern = uri_pattern(FIELDS[field])
    text = data.draw(st.one_of(st.from_regex(pattern, fullmatch=True), _SCHEMED))
    if re.fullmatch(pattern, text):
        assert re.fullmatch(BEFORE[field], text, re.ASCII), text


def _uris_in_the_repository() -> set[str]:
    """Every model, dataset and output URI the examples, docs and tests (but this one, which
    writes wrong ones on purpose) write."""
    found: set[str] = set()
    for folder, suffixes in (("examples", {".yaml"}), ("docs", {".md"}), ("tests", {".py"})):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in suffixes and path.is_file() and path != Path(__file__):
                text = path.read_text(errors="replace")
                found |= set(re.findall(r"\b(?:pvc|s3|hf|ftj)://[A-Za-z0-9][\w./@-]*", text))
    return {uri.rstrip(".") for uri in found}


def test_every_uri_the_repository_writes_is_admitted() -> None:
    uris = _uris_in_the_repository()
    assert len(uris) > 30
    patterns = [re.compile(uri_pattern(forms)) for forms in FIELDS.values()]
    refused = [u for u in uris if not any(p.fullmatch(u) for p in patterns)]
    assert refused == []


# --------------------------------------------------------------------------- the same answers


def _locate_before(uri: str, split_revision: bool) -> Location:
    """`control.build.storage.locate` before the parser, kept to hold the new one to it."""
    if uri.startswith("pvc://"):
        claim, _, sub = uri[len("pvc://") :].partition("/")
        sub = sub.strip("/")
        path = f"/mnt/pvc/{claim}/{sub}" if sub else f"/mnt/pvc/{claim}"
        return Location("path", path, claim=claim)
    if uri.startswith("s3://"):
        return Location("s3", uri)
    if uri.startswith(("https://", "http://")):
        return Location("https", uri)
    if uri.startswith("/"):
        return Location("path", uri)
    hub_id = uri[len("hf://") :] if uri.startswith("hf://") else uri
    hub_id = hub_id.strip("/")
    revision = None
    if split_revision and "@" in hub_id:
        hub_id, _, rev = hub_id.partition("@")
        revision = rev or None
    return Location("hub", hub_id, revision=revision)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    uri=st.one_of(
        st.from_regex(MODEL_URI_PATTERN, fullmatch=True),
        st.from_regex(DATASET_URI_PATTERN, fullmatch=True),
    ),
    split_revision=st.booleans(),
)
def test_locate_answers_as_before_for_every_admitted_uri(uri: str, split_revision: bool) -> None:
    assert locate(uri, split_revision=split_revision) == _locate_before(uri, split_revision)


@settings(max_examples=200, deadline=None)
@given(uri=st.from_regex(r"s3://[a-z0-9.-]{1,12}(/[A-Za-z0-9._/ -]{0,20})?", fullmatch=True))
def test_s3_uris_split_as_before(uri: str) -> None:
    """The stage-in and stage-out read bucket and key as urllib split them (bar `?` and `#`,
    which are part of a key now)."""
    before = urllib.parse.urlsplit(uri)
    if " " in uri:
        with pytest.raises(ConfigError, match="To fix"):
            parse_s3(uri, "dataset.uri")
        return
    assert parse_s3(uri, "dataset.uri") == (before.netloc, before.path.lstrip("/"))


def test_a_uri_that_is_not_s3_is_the_jobs_mistake() -> None:
    for uri in ["https://h/x", "s3:///k", "gs://b/k"]:
        with pytest.raises(ConfigError, match="To fix"):
            parse_s3(uri, "destination")


# --------------------------------------------------------------------------- gs:// everywhere


def test_gs_is_refused_with_the_fix_by_the_api_the_parser_and_the_planner() -> None:
    spec = {"model": {"uri": "Qwen/Qwen2.5-7B"}, "dataset": {"uri": "gs://b/train.jsonl"}}
    with pytest.raises(ValidationError) as err:
        FineTuneJobSpec.model_validate(spec)
    assert "spec.dataset.uri 'gs://b/train.jsonl': Google Cloud Storage" in str(err.value)
    assert "To fix: use s3://" in str(err.value)
    for pattern in (MODEL_URI_PATTERN, DATASET_URI_PATTERN, URI_PATTERN):
        assert not re.fullmatch(pattern, "gs://b/train.jsonl")
    # Named after a known model, which `kubetune estimate` once took from the path alone.
    with pytest.raises(ArchitectureError, match=r"not supported.*To fix: use s3://"):
        load_arch("gs://bucket/models/Llama-3.1-8B")


def test_the_api_says_what_is_wrong_with_a_uri() -> None:
    spec = {"model": {"uri": "ftj://Upper"}, "dataset": {"uri": "pvc:///x.jsonl"}}
    with pytest.raises(ValidationError) as err:
        FineTuneJobSpec.model_validate(spec)
    text = str(err.value)
    assert "spec.model.uri 'ftj://Upper' is not a ftj://<name> URI" in text
    assert "spec.dataset.uri 'pvc:///x.jsonl' is not a pvc://<claim>/<path> URI" in text
    with pytest.raises(ValidationError, match=r"a https:// URI is not what spec\.output\.uri"):
        FineTuneJobSpec.model_validate({**spec, "model": {"uri": "o/m"}, "dataset": {
            "uri": "/d.jsonl"}, "output": {"uri": "https://h/out"}})  # fmt: skip


# --------------------------------------------------------------------------- one parser

PRODUCT = {
    "kubetune": ROOT / "operator/src/kubetune",
    "kubetune_trainer": ROOT / "trainer_image/src/kubetune_trainer",
}
PARSER = ROOT / "trainer_image/src/kubetune_trainer/uris.py"
ALLOWED = {
    # A cache entry's readable name is the text after any scheme (its hash is the source's).
    ("kubetune_trainer/stagein/cache.py", "split"),
    # The liveness endpoint of `kubetune operator`: a URL of the operator's, not a job's URI.
    ("kubetune/controller/run.py", "urlsplit"),
}
_STRING_PARSES = {"startswith", "endswith", "removeprefix", "partition", "rpartition", "split",
                  "rsplit", "find", "rfind", "index", "rindex"}  # fmt: skip
_URL_PARSES = {"urlsplit", "urlparse"}
_SCHEME_PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _has_scheme(node: ast.AST) -> bool:
    constants = node.elts if isinstance(node, ast.Tuple) else [node]
    return any(
        isinstance(c, ast.Constant) and isinstance(c.value, str) and "://" in c.value
        for c in constants
    )


def _uri_parses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each place that takes a URI apart by its scheme without the parser."""
    in_fstrings = {
        id(value) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
        for value in node.values
    }  # fmt: skip
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            takes_a_scheme = any(_has_scheme(a) for a in node.args)
            if name in _URL_PARSES or (takes_a_scheme and name in (*_STRING_PARSES, "len")):
                found.append((node.lineno, name))
        elif isinstance(node, ast.Compare) and _has_scheme(node.left):
            found.append((node.lineno, "in"))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _SCHEME_PREFIX.fullmatch(node.value)
            and id(node) not in in_fstrings
        ):
            found.append((node.lineno, f"the scheme {node.value!r}"))
    return found


def test_no_second_uri_parse_in_the_product() -> None:
    """URIs are taken apart by `kubetune_trainer.uris` alone: a scheme compared, split off
    or looked up anywhere else is a second parser that the CRD's patterns do not bind."""
    offenders = []
    for package, folder in PRODUCT.items():
        for path in sorted(folder.rglob("*.py")):
            if path == PARSER:
                continue
            rel = f"{package}/{path.relative_to(folder)}"
            for line, what in _uri_parses(ast.parse(path.read_text(), str(path))):
                if (rel, what) not in ALLOWED:
                    offenders.append(f"{rel}:{line}: {what}")
    assert offenders == []


@pytest.mark.parametrize(
    "code",
    [
        'uri.startswith("pvc://")',
        'uri.startswith(("s3://", "/"))',
        'uri.partition("://")',
        'uri[len("hf://") :]',
        '"gs://" in uri',
        'PREFIXES = ("hf://", "ftj://")',
        "urllib.parse.urlsplit(uri)",
    ],
)
def test_the_scan_finds_a_second_parse(code: str) -> None:
    assert _uri_parses(ast.parse(code)) != []


def test_the_scan_lets_composition_be() -> None:
    assert _uri_parses(ast.parse('f"s3://{bucket}/{key}"; "see https://example.com"')) == []
