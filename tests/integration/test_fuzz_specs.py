"""Random and malformed FineTuneJob specs against the real kube-apiserver and the operator.

Hypothesis generates a mix of specs: valid ones with random field values (every method,
GPU counts, training numbers, deadlines, budgets, known and unknown pools, known and
unknown models, model URIs of every scheme), mutations of valid ones (wrong types,
negative/zero/huge numbers, empty, unicode and very long strings, NaN-like strings,
unknown and missing fields, deeply nested junk) and arbitrary JSON. Every spec is created
through the API, and for each one:

- either admission rejects it (HTTP 4xx) with a non-empty message,
- or the operator gives it a status within a bounded time: a `phase`, and a non-empty
  `status.message` when the phase is Failed; the operator's own model accepts what the
  CRD admitted (no `InvalidSpec` failure from the model itself);
- the operator process stays alive and logs no handler errors or tracebacks;
- deleting the admitted objects really removes them (no stuck finalizer) and garbage
  collection leaves no children behind except checkpoint volumes whose retention policy
  says `retain`.

Admitted jobs are handled in batches, each deleted before the next is created, so the
operator (polling every job every second here) is not swamped. The examples are all
generated first, then submitted.

Knobs (environment): KUBETUNE_FUZZ_EXAMPLES (specs to try, default 1000),
KUBETUNE_FUZZ_BATCH (admitted jobs per batch, default 60), KUBETUNE_FUZZ_SEED (an
integer, or `random`; default 0). A failure message names the seed and shows the
offending specs. See docs/fuzzing.md.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from kubetune.api.v1alpha1 import API_VERSION, GROUP, VERSION
from kubetune.control.build.names import child_names
from kubetune.control.build.storage import CACHE_CLAIM
from kubetune.planning.models_table import MODELS
from kubetune_dev.cli import simulated_pool_docs
from kubetune_dev.cluster import LocalCluster, process_alive
from support.apiserver import Api
from support.waiting import WaitTimeout, wait_for

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("KUBETUNE_FUZZ_EXAMPLES", "1000"))
BATCH = int(os.environ.get("KUBETUNE_FUZZ_BATCH", "60"))
_SEED_ENV = os.environ.get("KUBETUNE_FUZZ_SEED", "0")
SEED = random.randrange(2**32) if _SEED_ENV == "random" else int(_SEED_ENV)

# Liveness bounds (failure thresholds, not expectations): a batch normally settles,
# disappears and is garbage-collected in a few seconds.
SETTLE_TIMEOUT_S = 60.0
DELETE_TIMEOUT_S = 30.0
GC_TIMEOUT_S = 90.0

FTJ_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/finetunejobs"
MANAGED = "app.kubernetes.io/managed-by=kubetune"
CHILD_KINDS = {
    "Job": "/apis/batch/v1/namespaces/{ns}/jobs",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Service": "/api/v1/namespaces/{ns}/services",
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
}
RETENTION_ANNOTATION = f"{GROUP}/retention"

# ---------------------------------------------------------------------------- strategies

KNOWN_MODELS = sorted(m.hf_id for m in MODELS)
MODEL_ALIASES = sorted(a for m in MODELS for a in m.aliases)
POOLS = sorted(p["metadata"]["name"] for p in simulated_pool_docs())

# Characters and strings that trip parsers: control and invisible characters, Unicode
# whitespace (Go's \s is ASCII-only, Python's and Rust's are not), combining and
# right-to-left marks, astral characters, numbers and literals in string form.
TRICKY = [
    "",
    " ",
    "\t",
    "\n",
    "\r\n",
    "\v",
    "\f",
    "\x00",
    "\x1b[31m",
    "\x85",
    "\u00a0",
    "\u1680",
    "\u2003",
    "\u2028",
    "\u200b",
    "\u202e",
    "\u3000",
    "\ufeff",
    "\ufffd",
    "é",
    "e\u0301",
    "ß",
    "İ",
    "ﬁ",
    "Ω",
    "٣",
    "１２",
    "𝔘",
    "😀",
    "👩‍👩‍👧",
    "\ud800",
    "NaN",
    "nan",
    "-NaN",
    "Infinity",
    "-Infinity",
    "inf",
    "1e309",
    "-0",
    "0x1F",
    "1_000",
    "null",
    "true",
    "{}",
    "[]",
    "'",
    '"',
    "\\",
    "${HOME}",
    "$(id)",
    "../../..",
    "%00",
    "<script>",
]
NAN_LIKE = ["NaN", "nan", "-nan", "Infinity", "-Infinity", "inf", "+inf", "1e309", "NULL", "None"]
NASTY_NUMBERS: list[Any] = [
    0,
    -1,
    1,
    -0.0,
    0.5,
    2**31 - 1,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    10**30,
    1e-300,
    5e-324,
    1e308,
    1.7976931348623157e308,
]

FIELD_NAMES = sorted(
    {
        "model",
        "uri",
        "revision",
        "tokenSecretRef",
        "name",
        "key",
        "architecture",
        "dataset",
        "format",
        "validationSplit",
        "numExamples",
        "avgTokensPerExample",
        "totalTokens",
        "method",
        "lora",
        "rank",
        "alpha",
        "dropout",
        "targetModules",
        "doubleQuant",
        "training",
        "epochs",
        "maxSteps",
        "learningRate",
        "warmupRatio",
        "weightDecay",
        "sequenceLength",
        "globalBatchSize",
        "microBatchSize",
        "packing",
        "gradientCheckpointing",
        "precision",
        "optimizer",
        "seed",
        "resources",
        "gpus",
        "pools",
        "objective",
        "deadline",
        "maxCostUSD",
        "spot",
        "checkpoint",
        "intervalSteps",
        "intervalMinutes",
        "keep",
        "storage",
        "size",
        "storageClassName",
        "accessMode",
        "retention",
        "output",
        "mergeAdapter",
        "gguf",
        "quantization",
        "preTokenizer",
        "recovery",
        "maxOOMReplans",
        "maxRestarts",
        "maxPreemptionsWithoutProgress",
        "stallTimeoutSeconds",
        "trainerImage",
        "suspend",
        "ttlSecondsAfterFinished",
    }
)

# Device and kernel files: the operator must not read paths of its own filesystem at all.
SPECIAL_FILES = ["/dev/zero", "/dev/urandom", "/proc/self/mem", "file:///dev/zero", "/sys"]


def _ascii_regex(pattern: str) -> st.SearchStrategy[str]:
    return st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True)


dns_label = _ascii_regex(r"[a-z]([a-z0-9-]{0,14}[a-z0-9])?")
junk_text = st.one_of(
    st.sampled_from(TRICKY),
    st.text(max_size=24),
    st.text(st.characters(codec="ascii"), max_size=24),
    st.builds(lambda a, b, c: a + b + c, st.text(max_size=6), st.sampled_from(TRICKY), st.text()),
)
long_text = st.builds(
    lambda chunk, n: (chunk or "x") * n,
    st.sampled_from(["a", "/", "é", "ab-", "😀"]),
    st.integers(200, 20_000),
)
nasty_number = st.one_of(
    st.sampled_from(NASTY_NUMBERS),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
)
json_leaf: st.SearchStrategy[Any] = st.one_of(st.none(), st.booleans(), nasty_number, junk_text)
json_key = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=12))
json_value: st.SearchStrategy[Any] = st.recursive(
    json_leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(json_key, children, max_size=4)
    ),
    max_leaves=16,
)

path_segment = _ascii_regex(r"[A-Za-z0-9][\w.\-]{0,24}")
hub_id = st.one_of(
    _ascii_regex(r"[A-Za-z0-9][\w.\-]{0,20}/[\w.\-]{1,30}"),
    st.from_regex(r"[A-Za-z0-9][\w.\-]{0,12}(/[\w.\-]{1,16})?", fullmatch=True),
)
claim_name = st.one_of(
    dns_label,
    st.sampled_from(["models", "data", "Models", "my_claim", "a.b", "9lives", "x" * 254]),
)
model_path_tail = st.one_of(
    st.sampled_from(KNOWN_MODELS).map(lambda m: m.split("/")[-1]),
    st.lists(path_segment, min_size=0, max_size=3).map("/".join),
)
absolute_path = st.one_of(
    st.lists(path_segment, min_size=0, max_size=4).map(lambda parts: "/" + "/".join(parts)),
    # A name longer than a file system allows, in a folder that exists.
    st.builds(
        lambda a, n, b: f"{a}{'m' * n}/{b}",
        st.sampled_from(["/", "/tmp/"]),
        st.integers(200, 400),
        path_segment,
    ),
    st.builds(lambda a, t: f"/{a}{t}", path_segment, st.sampled_from(TRICKY)),
)
model_uri = st.one_of(
    st.sampled_from(KNOWN_MODELS + MODEL_ALIASES),
    st.sampled_from(KNOWN_MODELS).map(lambda m: f"hf://{m}"),
    st.builds(lambda m, r: f"hf://{m}@{r}", st.sampled_from(KNOWN_MODELS), path_segment),
    hub_id,
    hub_id.map(lambda m: f"hf://{m}"),
    st.builds(lambda c, p: f"pvc://{c}/{p}", claim_name, model_path_tail),
    st.builds(lambda b, p: f"s3://{b}/{p}", dns_label, model_path_tail),
    absolute_path,
    st.builds(lambda m, t: m + t, st.sampled_from(KNOWN_MODELS), st.sampled_from(TRICKY)),
    st.sampled_from(SPECIAL_FILES),
)
dataset_uri = st.one_of(
    st.builds(lambda c, p: f"pvc://{c}/{p}.jsonl", claim_name, path_segment),
    st.builds(lambda b, p: f"s3://{b}/{p}", dns_label, path_segment),
    absolute_path,
    hub_id,
    st.just("/data/train.jsonl"),
)
architecture = st.one_of(
    st.sampled_from(KNOWN_MODELS + MODEL_ALIASES),
    hub_id,
    st.sampled_from(["llama", "", " ", "Qwen/Qwen2.5-0.5B ", "config.json", "/", "./x.json"]),
    st.sampled_from(["~", "~/models", "~nosuchuser/config.json", "file:///tmp/none.json"]),
    absolute_path,
    junk_text,
    st.sampled_from(SPECIAL_FILES),
)
duration = st.one_of(
    st.builds(
        lambda parts: "".join(f"{n}{u}" for n, u in parts),
        st.lists(
            st.tuples(
                st.one_of(st.integers(0, 10_000).map(str), st.sampled_from(["0.5", "1.25", "0.0"])),
                st.sampled_from("hms"),
            ),
            min_size=1,
            max_size=3,
        ),
    ),
    st.sampled_from(["12h", "90m", "1h30m", "2562047h", "99999999999h", "0.000000001s"]),
)
quantity = st.one_of(
    st.builds(
        lambda n, u: f"{n}{u}", st.integers(0, 5000), st.sampled_from(["", "Mi", "Gi", "Ti"])
    ),
    st.sampled_from(["0", "0.5", "1.5Gi", "999999P", "100000000000000000000Ti"]),
)
image = st.sampled_from(
    [
        "kubetune/trainer:test",
        "registry.example.com:5000/team/trainer:v1",
        "ghcr.io/x/trainer@sha256:" + "a" * 64,
        "",
        " ",
        "Trainer:Latest",
        "img with space",
        "x" * 300,
    ]
)


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


def _pruned(d: dict[str, Any]) -> dict[str, Any]:
    """Drop unset (None) optional fields."""
    return {k: v for k, v in d.items() if v is not None}


def _section(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A dict with each field independently present or absent."""
    return st.fixed_dictionaries({k: _maybe(v) for k, v in fields.items()}).map(_pruned)


small_or_huge = st.one_of(st.integers(1, 5000), st.integers(1, 2**62), st.sampled_from([2**63 - 1]))


training_fields = _section(
    epochs=st.one_of(st.floats(0.01, 100), st.integers(1, 100)),
    maxSteps=st.one_of(st.integers(1, 50), small_or_huge),
    learningRate=st.floats(1e-7, 0.9),
    warmupRatio=st.floats(0, 0.99),
    weightDecay=st.floats(0, 10),
    sequenceLength=st.one_of(st.sampled_from([512, 2048, 8192]), st.integers(16, 1_048_576)),
    packing=st.booleans(),
    gradientCheckpointing=st.booleans(),
    precision=st.sampled_from(["bf16", "amp-bf16", "fp32"]),
    optimizer=st.sampled_from(["adamw", "adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit"]),
    chunkedCrossEntropy=st.booleans(),
    activationOffloading=st.booleans(),
    seed=st.integers(0, 2**62),
)
# (micro-batch, global batch as a multiple of it, or None for "no micro-batch given")
batch_sizes = st.one_of(
    st.none(),
    st.tuples(st.integers(1, 64), st.one_of(st.integers(1, 64), st.integers(1, 2**40))),
    st.tuples(st.none(), st.one_of(st.integers(1, 1024), small_or_huge)),
)


def _with_batch(section: dict[str, Any], sizes: tuple[int | None, int] | None) -> dict[str, Any]:
    if sizes is not None:
        micro, factor = sizes
        section["globalBatchSize"] = factor * (micro or 1)
        if micro is not None and factor % 2:
            section["microBatchSize"] = micro
    return section


training_section = st.builds(_with_batch, training_fields, batch_sizes)
model_section = st.builds(
    lambda uri, rest: {"uri": uri, **rest},
    model_uri,
    _section(
        revision=st.one_of(path_segment, junk_text),
        architecture=architecture,
        tokenSecretRef=_section(
            name=st.one_of(dns_label, st.sampled_from(["Bad Name", "a_b"])),
            key=st.sampled_from(["token", "HF_TOKEN", "", "a/b"]),
        ).map(lambda d: {"name": "hf-token", **d}),
    ),
)
dataset_section = st.builds(
    lambda uri, rest: {"uri": uri, **rest},
    dataset_uri,
    _section(
        format=st.sampled_from(["alpaca", "sharegpt", "chat", "instruction-response", "text"]),
        validationSplit=st.floats(0, 0.5),
        numExamples=st.one_of(st.integers(1, 100_000), small_or_huge),
        avgTokensPerExample=st.one_of(st.integers(1, 4096), small_or_huge),
        totalTokens=st.one_of(st.integers(1, 10**9), small_or_huge),
    ),
)
optional_sections = _section(
    lora=_section(
        rank=st.integers(1, 1024),
        alpha=st.integers(1, 4096),
        dropout=st.floats(0, 0.99),
        targetModules=st.lists(
            st.one_of(st.sampled_from(["all-linear", "q_proj", "v_proj", "lm_head"]), junk_text),
            min_size=1,
            max_size=4,
        ),
        doubleQuant=st.booleans(),
    ),
    training=training_section,
    resources=_section(
        gpus=st.one_of(st.just("auto"), st.integers(1, 64), st.integers(1, 5000)),
        pools=st.lists(
            st.one_of(
                st.sampled_from(POOLS), st.sampled_from(["tpu-v5", "", "L40S", "h100 ", "a" * 300])
            ),
            max_size=4,
        ),
        objective=st.sampled_from(["cost", "time"]),
        deadline=duration,
        maxCostUSD=st.one_of(st.floats(0.01, 1e6), st.floats(1e-9, 1e300)),
        spot=st.sampled_from(["never", "allowed", "preferred"]),
    ),
    checkpoint=_section(
        intervalSteps=st.integers(1, 10**9),
        intervalMinutes=st.floats(0.01, 1e6),
        keep=st.integers(1, 100),
        storage=_section(
            size=quantity,
            storageClassName=st.sampled_from(["kubetune-local", "missing-class", "", "Bad_Class"]),
            accessMode=st.sampled_from(["auto", "ReadWriteOnce", "ReadWriteMany"]),
            retention=st.sampled_from(["retain", "delete"]),
        ),
    ),
    output=_section(
        uri=st.one_of(
            st.builds(lambda c, p: f"pvc://{c}/{p}", claim_name, path_segment),
            st.builds(lambda b: f"s3://{b}/out", dns_label),
        ),
        mergeAdapter=st.booleans(),
        gguf=_section(
            quantization=st.sampled_from(["q8_0", "f16", "q4_k_m", "q3", "Q8_0"]),
            preTokenizer=st.sampled_from(["gpt-2", "llama-bpe", "Bad Name", ""]),
        ),
    ),
    recovery=_section(
        maxOOMReplans=st.integers(0, 20),
        maxRestarts=st.integers(0, 1000),
        maxPreemptionsWithoutProgress=st.integers(1, 1000),
        stallTimeoutSeconds=st.one_of(st.just(0), st.integers(1, 604_800)),
    ),
    trainerImage=image,
    suspend=st.sampled_from([False, False, False, True]),
    ttlSecondsAfterFinished=st.one_of(
        st.integers(0, 3600), st.sampled_from([2**31, 2**62, 2**63 - 1])
    ),
)


def _spec(method: str, model: Any, dataset: Any, optional: dict[str, Any]) -> dict[str, Any]:
    if method == "full":
        optional.pop("lora", None)
    return {"model": model, "dataset": dataset, "method": method, **optional}


# A spec within the documented API: every field optional but model and dataset.
valid_spec = st.builds(
    _spec,
    st.sampled_from(["auto", "full", "lora", "qlora"]),
    model_section,
    dataset_section,
    optional_sections,
)


# Paths into a spec: keys of dicts and indices of lists, from the root.
SpecPath = tuple[str | int, ...]


def _paths(value: Any, prefix: SpecPath = ()) -> Iterator[SpecPath]:
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _paths(child, (*prefix, i))


def _get(value: Any, path: SpecPath) -> Any:
    for key in path:
        value = value[key]
    return value


def _deep_junk(depth: int, leaf: Any) -> Any:
    value = leaf
    for i in range(depth):
        value = {"a": value} if i % 2 else [value]
    return value


def _other_type(kind: str, value: Any) -> bool:
    return _json_type(value) != kind


def _json_type(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


MUTATIONS = [
    "wrong-type",
    "number",
    "empty",
    "unicode",
    "long",
    "nan-like",
    "delete",
    "unknown-field",
    "nested-junk",
    "null",
    "non-json-number",
]


@st.composite
def mutated_spec(draw: st.DrawFn) -> tuple[Any, str]:
    """A valid spec with one to three random mutations; returns (spec, what was done)."""
    spec: Any = draw(valid_spec)
    done = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(spec))))
        op = draw(st.sampled_from(MUTATIONS))
        old = _get(spec, path)
        new: Any
        if op == "wrong-type":
            new = draw(json_value.filter(partial(_other_type, _json_type(old))))
        elif op == "number":
            new = draw(nasty_number)
        elif op == "empty":
            new = draw(st.sampled_from(["", [], {}, 0]))
        elif op == "unicode":
            tricky = draw(st.sampled_from(TRICKY))
            if isinstance(old, str):
                at = draw(st.integers(0, len(old)))
                new = old[:at] + tricky + old[at:]
            else:
                new = tricky + draw(st.text(max_size=8))
        elif op == "long":
            if isinstance(old, list) and old:
                size = len(json.dumps(old, allow_nan=True))
                new = old * draw(st.integers(50, max(50, 2000 * 200 // size)))
            elif isinstance(old, str):
                new = old + draw(long_text)
            else:
                new = draw(long_text)
        elif op == "nan-like":
            new = draw(st.sampled_from(NAN_LIKE))
        elif op == "non-json-number":
            new = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
        elif op == "nested-junk":
            new = _deep_junk(draw(st.integers(10, 120)), draw(json_leaf))
        elif op == "null":
            new = None
        elif op == "delete":
            if path:
                parent = _get(spec, path[:-1])
                if isinstance(parent, dict):
                    del parent[path[-1]]
                else:
                    parent.pop(path[-1])
                done.append(f"delete {_dotted(path)}")
            continue
        else:  # unknown-field
            target = old if isinstance(old, dict) else None
            if target is None:
                continue
            key = draw(st.one_of(st.sampled_from(FIELD_NAMES), st.text(min_size=1, max_size=12)))
            target.setdefault(key, draw(json_value))
            done.append(f"unknown-field {_dotted((*path, key))}")
            continue
        if path:
            _get(spec, path[:-1])[path[-1]] = new
        else:
            spec = new
        done.append(f"{op} {_dotted(path)}")
    return spec, "; ".join(done) or "no-op"


def _dotted(path: SpecPath) -> str:
    return "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


name_stem = st.one_of(
    st.just("fz"),
    _ascii_regex(r"[a-z0-9]([a-z0-9-]{0,12}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,12}[a-z0-9])?){0,3}"),
    st.integers(60, 240).map(lambda n: "n" * n),
)


@dataclass
class Case:
    origin: str
    """`valid`, `mutated: <what>` or `arbitrary`."""
    spec: Any
    stem: str

    def name(self, index: int) -> str:
        suffix = f"-{index:04d}"
        return self.stem[: 253 - len(suffix)] + suffix

    def body(self, index: int) -> bytes:
        doc = {
            "apiVersion": API_VERSION,
            "kind": "FineTuneJob",
            "metadata": {"name": self.name(index)},
            "spec": self.spec,
        }
        # allow_nan: the non-json-number mutation sends NaN/Infinity literals on purpose.
        return json.dumps(doc, allow_nan=True).encode()

    def show(self, index: int) -> str:
        """Name, origin and spec for a failure message (long strings and lists shortened)."""
        text = json.dumps(_abbreviated(self.spec), ensure_ascii=True, allow_nan=True)
        if len(text) > 1200:
            text = text[:1200] + f"... ({len(text)} characters)"
        name = self.name(index)
        if len(name) > 40:
            name = f"{name[:12]}…{name[-12:]} ({len(name)} characters)"
        return f"{name} [{self.origin}] spec={text}"


def _abbreviated(value: Any) -> Any:
    if isinstance(value, str) and len(value) > 60:
        return f"{value[:40]}…(+{len(value) - 40} characters)"
    if isinstance(value, list):
        head = [_abbreviated(v) for v in value[:8]]
        return [*head, f"…(+{len(value) - 8} items)"] if len(value) > 8 else head
    if isinstance(value, dict):
        return {_abbreviated(k): _abbreviated(v) for k, v in value.items()}
    return value


@st.composite
def fuzz_case(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(["valid"] * 9 + ["mutated"] * 7 + ["arbitrary"] * 4))
    stem = draw(name_stem)
    if kind == "valid":
        return Case("valid", draw(valid_spec), stem)
    if kind == "mutated":
        spec, what = draw(mutated_spec())
        return Case(f"mutated: {what}", spec, stem)
    spec = draw(
        st.one_of(json_value, st.dictionaries(st.sampled_from(FIELD_NAMES), json_value, max_size=6))
    )
    return Case("arbitrary", spec, stem)


def generate_cases(count: int, seed_value: int) -> list[Case]:
    """`count` distinct cases, drawn by Hypothesis from a fixed seed."""
    cases: list[Case] = []
    seen: set[str] = set()
    for round_ in range(5):
        if len(cases) >= count:
            break

        # Ask for more than needed: a few draws repeat earlier ones.
        @seed(seed_value + round_)
        @settings(
            max_examples=(count - len(cases)) * 11 // 10 + 20,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(fuzz_case())
        def collect(case: Case) -> None:
            key = json.dumps(case.spec, sort_keys=True, allow_nan=True)
            if key not in seen and len(cases) < count:
                seen.add(key)
                cases.append(case)

        collect()
    return cases


# ---------------------------------------------------------------------------- watching


@dataclass
class Seen:
    """What the watch saw of one FineTuneJob."""

    phases: list[str] = field(default_factory=list)
    bad_failure: dict[str, Any] | None = None
    """A Failed status without a message."""
    invalid_spec: str | None = None
    """The operator's message when it judged an admitted spec invalid."""
    last: dict[str, Any] = field(default_factory=dict)


class Watch(threading.Thread):
    """Records every change of the FineTuneJobs in a namespace (short server-side watches)."""

    def __init__(self, api: Api, namespace: str) -> None:
        super().__init__(daemon=True, name="fuzz-watch")
        self.api = api
        self.path = FTJ_PATH.format(ns=namespace)
        self.seen: dict[str, Seen] = {}
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.started_watching = threading.Event()
        self.errors: list[str] = []

    def get(self, name: str) -> Seen:
        with self.lock:
            return copy.deepcopy(self.seen.get(name, Seen()))

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=30)

    def run(self) -> None:
        version: str | None = None
        while not self.halt.is_set():
            conn = self.api.connect(timeout=30)
            try:
                if version is None:
                    conn.request("GET", self.path, headers={"Accept": "application/json"})
                    listing = json.loads(conn.getresponse().read())
                    for obj in listing["items"]:
                        self._record(obj)
                    version = listing["metadata"]["resourceVersion"]
                query = (
                    f"?watch=1&allowWatchBookmarks=true&timeoutSeconds=5&resourceVersion={version}"
                )
                conn.request("GET", self.path + query, headers={"Accept": "application/json"})
                response = conn.getresponse()
                if response.status != 200:
                    version = None
                    response.read()
                    continue
                self.started_watching.set()
                while line := response.readline():
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        version = None  # e.g. 410 Gone: list again
                        break
                    version = event["object"]["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self._record(event["object"])
            except (http.client.HTTPException, OSError, ValueError, KeyError) as exc:
                self.errors.append(repr(exc))
                time.sleep(0.2)
            finally:
                conn.close()

    def _record(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        status = obj.get("status") or {}
        phase = status.get("phase")
        with self.lock:
            seen = self.seen.setdefault(name, Seen())
            seen.last = obj
            if phase and (not seen.phases or seen.phases[-1] != phase):
                seen.phases.append(phase)
            if phase == "Failed" and not (status.get("message") or "").strip():
                seen.bad_failure = status
            for cond in status.get("conditions") or []:
                # Only the operator's own model disagreeing with the CRD counts; a spec that
                # is valid in form but wrong for its model (LoRA targets it lacks) or that
                # Kubernetes refuses in a child object ends InvalidSpec with its reason.
                message = cond.get("message") or status.get("message") or "?"
                if (
                    cond.get("type") == "Failed"
                    and cond.get("reason") == "InvalidSpec"
                    and message.startswith("invalid FineTuneJob:")
                ):
                    seen.invalid_spec = message


# ---------------------------------------------------------------------------- the test


LOG_RECORD = re.compile(r"^\[\d{4}-\d\d-\d\d [^\]]*\] \S+\s+\[(\w+)\s*\] ?(.*)$")
OBJECT_PREFIX = re.compile(r"^\[([^/\]\s]+)/([^\]\s]+)\] ")
TRACEBACK_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+), in (\S+)')
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b")


@dataclass
class LogError:
    level: str
    name: str | None
    """The FineTuneJob it is about (None: not about one object)."""
    first: str
    last: str
    """The record's last line: for a traceback, the exception."""
    where: str = ""
    """For a traceback: where it was raised, `file.py:line in function`."""

    @property
    def signature(self) -> str:
        """The exception (or message) with names, numbers and quoted values blanked."""
        text = self.last if EXCEPTION_LINE.match(self.last) else OBJECT_PREFIX.sub("", self.first)
        text = re.sub(r"""(["'])[^"']*(\1|$)""", "'…'", _squeezed(text))
        text = re.sub(r"\d+", "N", text)[:160]
        return f"{text} (at {self.where})" if self.where else text


def _squeezed(text: str, limit: int = 400) -> str:
    """`text` with long runs of one character shortened, cut at `limit`."""
    text = re.sub(r"(.)\1{11,}", lambda m: f"{m.group(1) * 3}…(×{len(m.group(0))})", text)
    return text if len(text) <= limit else text[:limit] + "…"


class Operator:
    """The operator process: liveness, and the errors it logged since the test began."""

    def __init__(self, local: LocalCluster, log: Path, namespace: str) -> None:
        self.pid = local.state.pids["operator"]
        self.log = log
        self.namespace = namespace
        self.offset = log.stat().st_size if log.exists() else 0
        self.errors: list[LogError] = []
        """Error records about the test's objects, and tracebacks."""
        self.erred: set[str] = set()
        self.notices = 0
        """Operator-wide error records without a traceback (retried API calls)."""
        self._lines: list[str] = []

    def check_alive(self) -> None:
        if not process_alive(self.pid):
            self.read_log()
            raise AssertionError(
                f"the operator died; its log ends:\n{self.log.read_text(errors='replace')[-4000:]}"
            )

    def read_log(self) -> None:
        """Parse the complete lines written since the last call."""
        with self.log.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].decode(errors="replace").splitlines():
            if LOG_RECORD.match(line):
                self._finish_record()
            self._lines.append(line)

    def finish(self) -> None:
        self.read_log()
        self._finish_record()

    def _finish_record(self) -> None:
        record, self._lines = self._lines, []
        if not record:
            return
        match = LOG_RECORD.match(record[0])
        level, message = (match.group(1), match.group(2)) if match else ("?", record[0])
        traceback = any(line.startswith("Traceback (most recent call last)") for line in record)
        if level not in ("ERROR", "CRITICAL") and not traceback:
            return
        obj = OBJECT_PREFIX.match(message)
        if obj and obj.group(1) != self.namespace:
            return  # about another test's object
        if not obj and not traceback:
            # kopf's own notices, e.g. an API request it retries after HTTP 429.
            self.notices += 1
            return
        name = obj.group(2) if obj else None
        # The innermost frame of kubetune's own code, else the innermost one.
        frames = [m for m in map(TRACEBACK_FRAME.match, record) if m]
        ours = [m for m in frames if "/kubetune/" in m.group(1)] or frames
        where = ""
        if ours:
            where = f"{Path(ours[-1].group(1)).name}:{ours[-1].group(2)} in {ours[-1].group(3)}"
        self.errors.append(LogError(level, name, message[:4000], record[-1][:4000], where))
        if name:
            self.erred.add(name)


@dataclass
class Report:
    cases: dict[str, tuple[int, Case]] = field(default_factory=dict)
    problems: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    """category → (object name, detail)"""
    rejected: Counter[str] = field(default_factory=Counter)
    final_phase: Counter[str] = field(default_factory=Counter)
    origins: Counter[str] = field(default_factory=Counter)
    slowest: dict[str, float] = field(default_factory=dict)
    total: dict[str, float] = field(default_factory=dict)
    batches: int = 0

    def problem(self, category: str, name: str, detail: str = "") -> None:
        self.problems.setdefault(category, []).append((name, detail))

    def took(self, step: str, seconds: float) -> None:
        self.slowest[step] = max(self.slowest.get(step, 0.0), seconds)
        self.total[step] = self.total.get(step, 0.0) + seconds

    def spec(self, name: str) -> str:
        if name not in self.cases:
            return f"{name} (not one of the generated specs)"
        index, case = self.cases[name]
        return case.show(index)

    def render(self, operator: Operator, limit: int = 3) -> str:
        """Each category of problem with its first few objects, their specs and log lines."""
        said: dict[str, LogError] = {}
        for error in operator.errors:
            if error.name:
                said.setdefault(error.name, error)
        lines = []
        for category, items in self.problems.items():
            lines.append(f"* {category}: {len(items)} object(s)")
            for name, detail in items[:limit]:
                lines.append(f"  - {self.spec(name)}")
                if detail:
                    lines.append(f"    {detail}")
                if name in said:
                    lines.append(f"    operator log: {_squeezed(said[name].first, 300)}")
                    if said[name].last != said[name].first:
                        lines.append(f"                  {_squeezed(said[name].last, 300)}")
        return "\n".join(lines)


def settle(operator: Operator, timeout: float, done: Callable[[], bool]) -> bool:
    """Whether `done()` held within `timeout` seconds; the operator must stay alive meanwhile."""

    def probe() -> bool:
        operator.check_alive()
        return done()

    try:
        wait_for("the batch to settle", probe, timeout, interval=0.5)
    except WaitTimeout:
        return False
    return True


def children(api: Api, namespace: str) -> list[dict[str, Any]]:
    out = []
    for kind, path in CHILD_KINDS.items():
        url = path.format(ns=namespace) + "?labelSelector=" + quote(MANAGED)
        code, body = api.request("GET", url)
        assert code == 200, f"listing {kind}: HTTP {code} {body}"
        out += [{**item, "kind": kind} for item in body["items"]]
    return out


def pod_creation_failures(api: Api, namespace: str, report: Report) -> None:
    """Batch Jobs whose pods Kubernetes refuses to create (the Job controller's Events).

    Such a job shows Running but can never run: the operator built an invalid pod
    template from a spec the CRD admitted.
    """
    owners: dict[str, str] = {}
    for name in report.cases:
        for attempt in (1, 2, 3):
            with contextlib.suppress(ValueError):
                owners[child_names(name, attempt).job] = name
    url = f"/api/v1/namespaces/{namespace}/events?fieldSelector=" + quote("reason=FailedCreate")
    code, body = api.request("GET", url)
    assert code == 200, f"listing events: HTTP {code} {body}"
    seen = set()
    for event in body["items"]:
        involved = event.get("involvedObject") or {}
        if involved.get("kind") != "Job" or involved.get("name") not in owners:
            continue
        message = re.sub(r'Pod "[^"]*"', "Pod", event.get("message") or "")
        message = re.sub(r"""(["'])[^"']*\1""", "'…'", message)[:200]
        owner = owners[involved["name"]]
        if (owner, message) not in seen:
            seen.add((owner, message))
            report.problem(f"the batch Job cannot create its pods: {message}", owner)


def is_retained_volume(obj: dict[str, Any]) -> bool:
    """A claim meant to outlive the jobs: a checkpoint volume kept by `retain`, or the
    namespace's model and data cache (which no job owns, docs/data.md)."""
    meta = obj["metadata"]
    if obj["kind"] != "PersistentVolumeClaim" or meta.get("ownerReferences"):
        return False
    cache = meta.get("name") == CACHE_CLAIM
    return cache or (meta.get("annotations") or {}).get(RETENTION_ANNOTATION) == "retain"


def run_batch(
    api: Api,
    watch: Watch,
    operator: Operator,
    report: Report,
    namespace: str,
    cases: list[tuple[int, Case]],
) -> None:
    """Create the admitted objects of one batch, wait for status, delete, check cleanup."""
    path = FTJ_PATH.format(ns=namespace)
    admitted: list[str] = []
    t0 = time.monotonic()
    for index, case in cases:
        name = case.name(index)
        report.cases[name] = (index, case)
        report.origins[case.origin.split(":")[0]] += 1
        code, body = api.request("POST", path, case.body(index))
        message = body.get("message", "") if isinstance(body, dict) else str(body)
        if code == 409 and api.request("GET", f"{path}/{name}")[0] == 200:
            code = 201  # created by a first attempt whose answer was lost
        if code in (200, 201):
            admitted.append(name)
        elif 400 <= code < 500 and code != 409 and message.strip():
            reason = body.get("reason", "?") if isinstance(body, dict) else "?"
            report.rejected[f"{code} {reason}"] += 1
        else:
            report.problem(
                "admission answered neither 2xx nor 4xx with a message",
                name,
                f"HTTP {code} {message[:300]!r}",
            )
    report.took("submit", time.monotonic() - t0)

    # Every admitted object gets a phase; one the operator logged an error for is not
    # waited on (the error is reported below).
    def settled() -> bool:
        operator.read_log()
        return all(watch.get(n).phases or n in operator.erred for n in admitted)

    t0 = time.monotonic()
    settle(operator, SETTLE_TIMEOUT_S, settled)
    report.took("settle", time.monotonic() - t0)
    for name in admitted:
        seen = watch.get(name)
        if not seen.phases:
            last = seen.last.get("status")
            status = f"status={json.dumps(last)[:300]}" if last else ""
            if name in operator.erred:
                report.problem("admitted, no status.phase, operator error", name, status)
            else:
                report.problem(
                    f"admitted, no status.phase within {SETTLE_TIMEOUT_S:.0f}s", name, status
                )
        if seen.bad_failure is not None:
            report.problem(
                "phase Failed without status.message", name, json.dumps(seen.bad_failure)[:300]
            )
        if seen.invalid_spec is not None:
            why = re.sub(r"^invalid FineTuneJob: ", "", seen.invalid_spec)
            report.problem(
                f"admitted by the CRD, rejected by the operator's model (InvalidSpec): {why[:160]}",
                name,
            )

    # Delete the batch; every object must really disappear (no finalizer left stuck).
    t0 = time.monotonic()
    for name in admitted:
        code, body = api.request("DELETE", f"{path}/{name}")
        assert code in (200, 202, 404), f"deleting {name}: HTTP {code} {body}"
    present = set(admitted)

    def all_gone() -> bool:
        code, body = api.request("GET", path)
        assert code == 200, f"listing FineTuneJobs: HTTP {code} {body}"
        present.intersection_update(item["metadata"]["name"] for item in body["items"])
        return not present

    settle(operator, DELETE_TIMEOUT_S, all_gone)
    report.took("delete", time.monotonic() - t0)
    for name in admitted:
        seen = watch.get(name)
        report.final_phase[seen.phases[-1] if seen.phases else "(none)"] += 1
        if name in present:
            meta = seen.last.get("metadata", {})
            last = seen.last.get("status") or {}
            report.problem(
                f"still present {DELETE_TIMEOUT_S:.0f}s after deletion",
                name,
                f"finalizers={meta.get('finalizers')} deletionTimestamp="
                f"{meta.get('deletionTimestamp')} phase={last.get('phase')} "
                f"message={str(last.get('message'))[:200]!r}",
            )
            # Let the namespace go away after the test.
            api.request(
                "PATCH",
                f"{path}/{name}",
                json.dumps({"metadata": {"finalizers": None}}).encode(),
                "application/merge-patch+json",
            )

    # Garbage collection removes every child but checkpoint volumes kept by `retain` and the
    # namespace's cache.
    def leftovers() -> list[dict[str, Any]]:
        return [c for c in children(api, namespace) if not is_retained_volume(c)]

    t0 = time.monotonic()
    if not settle(operator, GC_TIMEOUT_S, lambda: not leftovers()):
        for child in leftovers():
            meta = child["metadata"]
            owner = (meta.get("ownerReferences") or [{}])[0].get("name", "?")
            report.problem(
                f"child left behind {GC_TIMEOUT_S:.0f}s after its FineTuneJob was deleted",
                owner,
                f"{child['kind']} {meta['name']} annotations={meta.get('annotations')} "
                f"finalizers={meta.get('finalizers')}",
            )
    report.took("gc", time.monotonic() - t0)
    pvcs = CHILD_KINDS["PersistentVolumeClaim"].format(ns=namespace)
    for child in children(api, namespace):
        if is_retained_volume(child) and "deletionTimestamp" not in child["metadata"]:
            api.request("DELETE", f"{pvcs}/{child['metadata']['name']}")
    report.batches += 1


def batches(cases: list[Case], batch: int) -> Iterator[list[tuple[int, Case]]]:
    """Consecutive cases in groups holding about `batch` specs likely to be admitted.

    Rejected specs cost the operator nothing, so a group ends after `batch` valid cases
    (most of them are admitted, and some of the mutated ones).
    """
    group: list[tuple[int, Case]] = []
    weight = 0
    for index, case in enumerate(cases):
        group.append((index, case))
        weight += case.origin == "valid"
        if weight >= batch:
            yield group
            group, weight = [], 0
    if group:
        yield group


def test_random_and_malformed_specs(
    local_cluster: LocalCluster,
    operator: Path,
    namespace: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    t0 = time.monotonic()
    cases = generate_cases(EXAMPLES, SEED)
    generated_s = time.monotonic() - t0
    assert len(cases) >= EXAMPLES, f"generated only {len(cases)} distinct specs"

    op = Operator(local_cluster, operator, namespace)
    api = Api(local_cluster)
    watch = Watch(Api(local_cluster), namespace)
    report = Report()
    watch.start()
    try:
        assert watch.started_watching.wait(30), f"the watch did not start: {watch.errors}"
        for group in batches(cases, BATCH):
            run_batch(api, watch, op, report, namespace, group)
        pod_creation_failures(api, namespace, report)
    finally:
        watch.stop()
        api.close()
    op.check_alive()
    op.finish()

    # The operator's own account: no handler error or traceback for any of our objects.
    reported = set()
    for error in op.errors:
        category = f"operator log {error.level}: {error.signature}"
        if (category, error.name) not in reported:
            reported.add((category, error.name))
            report.problem(category, error.name or "(no object)")

    admitted = sum(report.final_phase.values())
    rejected = sum(report.rejected.values())
    phases = ", ".join(f"{k} {v}" for k, v in sorted(report.final_phase.items()))
    origins = ", ".join(f"{k} {v}" for k, v in sorted(report.origins.items()))
    reasons = ", ".join(f"{k}: {v}" for k, v in report.rejected.most_common())
    steps = ", ".join(
        f"{k} {report.total[k]:.0f}s (max {v:.1f}s)" for k, v in report.slowest.items()
    )
    summary = (
        f"fuzz summary: {len(cases)} specs tried (seed {SEED}; {origins}): "
        f"{rejected} rejected at admission ({reasons}), {admitted} admitted "
        f"(last phase seen: {phases}); {report.batches} batches: {steps}; "
        f"{sum(len(v) for v in report.problems.values())} problems "
        f"({op.notices} operator-wide error notices not counted); "
        f"{time.monotonic() - t0:.1f}s (generation {generated_s:.1f}s)"
    )
    with capsys.disabled():
        print(f"\n{summary}", file=sys.stderr)
    if report.problems:
        pytest.fail(
            f"{summary}\n\nKUBETUNE_FUZZ_SEED={SEED} KUBETUNE_FUZZ_EXAMPLES={EXAMPLES} "
            f"KUBETUNE_FUZZ_BATCH={BATCH} reproduces this.\n{report.render(op)}",
            pytrace=False,
        )
