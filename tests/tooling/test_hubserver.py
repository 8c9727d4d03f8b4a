"""The real huggingface_hub client (and transformers) against the hub stand-in
(support/hubserver.py): what the client asks, what it gets, and what it raises.

These pin the client's behaviour that the trainer's hub code relies on, as observed against
the stand-in:

- a second `snapshot_download` of an unchanged revision asks the hub one question (the repo
  info, to resolve the branch) and downloads nothing: with `local_dir` the client trusts its
  `.cache/huggingface/download/*.metadata` (same commit), with a cache dir its snapshot folder;
  after the branch moves it HEADs each file and downloads only those whose ETag changed;
- a 503 is retried by the client itself only on a file's HEAD (at once, then with backoff, up
  to 6 more tries); a 503 on the repo info makes `snapshot_download` fall back to what is on
  disk: nothing there, `LocalEntryNotFoundError` (caused by the `HfHubHTTPError`); a complete
  snapshot (cache dir or `local_dir`), that snapshot, no error; an incomplete one,
  `IncompleteSnapshotError`. A 503 on a file's GET is raised as `HfHubHTTPError`. Retrying is
  our code's job (kubetune_trainer.hub);
- a body cut short is resumed with a Range request from the last whole 10 MiB chunk the client
  kept; cut within the first chunk, the file is fetched again from the start;
- a private repository without access raises `RepositoryNotFoundError` (401 anonymous, 404 with
  another valid token), a gated one `GatedRepoError` (401 / 403), and a token the hub does not
  know is a plain `HfHubHTTPError` 401 on every repository.
"""

from __future__ import annotations

import hashlib
import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub", reason="the hub stand-in's tests need the trainer extra")

import huggingface_hub
from huggingface_hub import HfApi, constants, hf_hub_download, hf_hub_url, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from support.hubserver import HubRequest, HubServer, hub_server

pytestmark = pytest.mark.tooling

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}
WEIGHTS = random.Random(0).randbytes(1024 * 1024)
MODEL = {
    "config.json": json.dumps(CONFIG).encode(),
    "tokenizer_config.json": b'{"model_max_length": 128}',
    "README.md": b"# tiny\n",
    "extra/notes.txt": b"a file in a folder\n",
    "model.bin": WEIGHTS,
}
"""Four regular files and one LFS file (1 MiB, served through the stand-in's CDN)."""


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubServer]:
    with hub_server() as server:
        server.patch(monkeypatch, cache_dir=tmp_path / "hf-cache")
        yield server


def files_in(root: str | Path) -> dict[str, bytes]:
    """The files of a download folder, without the client's `.cache/` bookkeeping."""
    base = Path(root)
    return {
        p.relative_to(base).as_posix(): p.read_bytes()
        for p in base.rglob("*")
        if p.is_file() and p.relative_to(base).parts[0] != ".cache"
    }


def since(hub: HubServer, mark: int) -> list[HubRequest]:
    return hub.requests()[mark:]


def test_snapshot_download_gives_identical_files_and_the_commit(
    hub: HubServer, tmp_path: Path
) -> None:
    sha = hub.add_model("org/tiny", MODEL)

    out = snapshot_download("org/tiny", local_dir=tmp_path / "local")
    assert out == str((tmp_path / "local").resolve())
    assert files_in(out) == MODEL
    meta = (tmp_path / "local/.cache/huggingface/download/config.json.metadata").read_text()
    assert meta.splitlines()[0] == sha
    # Info, tree, a HEAD and a GET per file. The LFS file's HEAD is a redirect to the CDN,
    # where its GET goes.
    first = hub.requests()
    assert first[:2] == [
        HubRequest("GET", "/api/models/org/tiny/revision/main", 200),
        HubRequest("GET", f"/api/models/org/tiny/tree/{sha}", 200),
    ]
    heads = {
        r.path.removeprefix(f"/org/tiny/resolve/{sha}/"): r.status
        for r in first
        if r.method == "HEAD"
    }
    assert heads == {"config.json": 200, "tokenizer_config.json": 200, "README.md": 200,
                     "extra/notes.txt": 200, "model.bin": 302}  # fmt: skip
    gets = sorted(r.path for r in first[2:] if r.method == "GET")
    assert gets[0] == f"/lfs/models/org/tiny/{hashlib.sha256(WEIGHTS).hexdigest()}"
    assert gets[1:] == sorted(f"/org/tiny/resolve/{sha}/{p}" for p in MODEL if p != "model.bin")
    assert len(first) == 2 + 2 * len(MODEL)
    assert hub.downloads() == hub.downloads("org/tiny") == len(MODEL)
    assert hub.downloads("org/other") == 0

    cached = snapshot_download("org/tiny", cache_dir=tmp_path / "cache")
    assert Path(cached).name == sha
    assert files_in(cached) == MODEL
    assert (tmp_path / "cache/models--org--tiny/refs/main").read_text() == sha
    assert HfApi().model_info("org/tiny").sha == sha
    assert huggingface_hub.model_info("org/tiny").sha == sha  # the module-level HfApi


def test_a_revision_other_than_main_and_an_old_commit(hub: HubServer, tmp_path: Path) -> None:
    first = hub.add_model("org/tiny", MODEL)
    v2_files = {**MODEL, "README.md": b"# tiny, v2\n"}
    v2 = hub.add_model("org/tiny", v2_files, revision="v2")
    moved = hub.add_model("org/tiny", {"config.json": MODEL["config.json"]})
    assert len({first, v2, moved}) == 3

    out = snapshot_download("org/tiny", revision="v2", local_dir=tmp_path / "v2")
    assert files_in(out) == v2_files
    assert HfApi().model_info("org/tiny", revision="v2").sha == v2

    assert files_in(snapshot_download("org/tiny", local_dir=tmp_path / "main")) == {
        "config.json": MODEL["config.json"]
    }
    # main has moved on; its old commit stays reachable by id, and the same files give the
    # same commit id.
    old = snapshot_download("org/tiny", revision=first, cache_dir=tmp_path / "cache")
    assert Path(old).name == first
    assert files_in(old) == MODEL
    assert hub.add_model("org/tiny", MODEL, revision="again") == first
    branches = {ref.name: ref.target_commit for ref in HfApi().list_repo_refs("org/tiny").branches}
    assert branches == {"main": moved, "v2": v2, "again": first}


def test_a_dataset_repo(hub: HubServer, tmp_path: Path) -> None:
    rows = b"".join(json.dumps({"i": i}).encode() + b"\n" for i in range(100))
    data = {"train.jsonl": rows, "data/train-00000.parquet": WEIGHTS[:4096]}
    sha = hub.add_dataset("org/set", data)

    out = snapshot_download("org/set", repo_type="dataset", local_dir=tmp_path / "set")
    assert files_in(out) == data
    assert HfApi().dataset_info("org/set").sha == sha
    assert all(
        r.path.startswith(
            ("/api/datasets/org/set", "/datasets/org/set/resolve/", "/lfs/datasets/org/set/")
        )
        for r in hub.requests()
    )
    assert hub.downloads("org/set", repo_type="dataset") == 2
    path = hf_hub_download("org/set", "train.jsonl", repo_type="dataset", cache_dir=tmp_path / "c")
    assert Path(path).read_bytes() == rows
    # The same id as a model is another repository, which does not exist.
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/set", local_dir=tmp_path / "model")


def test_a_private_repo_needs_its_token(hub: HubServer, tmp_path: Path) -> None:
    sha = hub.add_model("org/private", MODEL, token="hf_owner")
    hub.add_model("org/public", MODEL, token=None)
    hub.add_model("org/someone-elses", MODEL, token="hf_someone")

    out = snapshot_download("org/private", token="hf_owner", local_dir=tmp_path / "ok")
    assert files_in(out) == MODEL
    assert HfApi().model_info("org/private", token="hf_owner").private is True

    # No token: answered like a missing repository (401), raised as RepositoryNotFoundError.
    with pytest.raises(RepositoryNotFoundError) as anonymous:
        snapshot_download("org/private", local_dir=tmp_path / "anon")
    assert type(anonymous.value) is RepositoryNotFoundError
    assert anonymous.value.response.status_code == 401
    # A valid token without access: 404, the same exception.
    with pytest.raises(RepositoryNotFoundError) as other:
        snapshot_download("org/private", token="hf_someone", local_dir=tmp_path / "other")
    assert type(other.value) is RepositoryNotFoundError
    assert other.value.response.status_code == 404
    # A token the hub does not know: 401 "Invalid credentials", a plain HfHubHTTPError (not a
    # RepositoryNotFoundError), on a private repository and on a public one alike.
    for repo in ("org/private", "org/public"):
        with pytest.raises(HfHubHTTPError) as unknown:
            snapshot_download(repo, token="hf_typo", local_dir=tmp_path / "typo")
        assert type(unknown.value) is HfHubHTTPError
        assert unknown.value.response.status_code == 401
        assert "Invalid credentials in Authorization header" in str(unknown.value)
    # A single file without the token: the same RepositoryNotFoundError.
    with pytest.raises(RepositoryNotFoundError) as file_anon:
        hf_hub_download("org/private", "config.json", revision=sha, cache_dir=tmp_path / "c")
    assert type(file_anon.value) is RepositoryNotFoundError


def test_a_gated_repo_serves_files_to_its_token_only(hub: HubServer, tmp_path: Path) -> None:
    hub.add_model("org/gated", MODEL, token="hf_accepted", gated=True)
    hub.add_model("org/someone-elses", MODEL, token="hf_not_accepted")

    out = snapshot_download("org/gated", token="hf_accepted", local_dir=tmp_path / "ok")
    assert files_in(out) == MODEL
    # Its info and listing are public, as on the hub; the files are not.
    info = HfApi().model_info("org/gated")
    assert (info.gated, info.private) == ("manual", False)
    assert sorted(HfApi().list_repo_files("org/gated")) == sorted(MODEL)

    with pytest.raises(GatedRepoError) as anonymous:
        snapshot_download("org/gated", local_dir=tmp_path / "anon")
    assert anonymous.value.response.status_code == 401
    assert "restricted" in str(anonymous.value)
    with pytest.raises(GatedRepoError) as not_accepted:
        snapshot_download("org/gated", token="hf_not_accepted", local_dir=tmp_path / "other")
    assert not_accepted.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as unknown:
        snapshot_download("org/gated", token="hf_typo", local_dir=tmp_path / "typo")
    assert type(unknown.value) is HfHubHTTPError
    assert unknown.value.response.status_code == 401
    with pytest.raises(GatedRepoError):
        hf_hub_download("org/gated", "config.json", cache_dir=tmp_path / "c")


def test_unknown_repo_revision_and_file(hub: HubServer, tmp_path: Path) -> None:
    sha = hub.add_model("org/tiny", MODEL, token="hf_owner")

    with pytest.raises(RepositoryNotFoundError) as repo:
        snapshot_download("org/nope", local_dir=tmp_path / "a")
    assert type(repo.value) is RepositoryNotFoundError
    assert repo.value.response.status_code == 401  # anonymous: the hub says 401, not 404
    with pytest.raises(RepositoryNotFoundError) as repo_token:
        snapshot_download("org/nope", token="hf_owner", local_dir=tmp_path / "b")
    assert repo_token.value.response.status_code == 404

    with pytest.raises(RevisionNotFoundError):
        snapshot_download("org/tiny", revision="nope", token="hf_owner", local_dir=tmp_path / "c")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("org/tiny", revision="0" * 40, token="hf_owner", local_dir=tmp_path / "d")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("org/tiny", "config.json", revision="nope", token="hf_owner")

    with pytest.raises(RemoteEntryNotFoundError) as entry:
        hf_hub_download("org/tiny", "nope.json", token="hf_owner", cache_dir=tmp_path / "e")
    assert entry.value.response.status_code == 404
    # The client remembers the miss under the commit the hub named.
    assert (tmp_path / f"e/models--org--tiny/.no_exist/{sha}/nope.json").exists()
    assert hub.downloads() == 0
    assert not HfApi().file_exists("org/tiny", "nope.json", token="hf_owner")
    assert HfApi().file_exists("org/tiny", "model.bin", token="hf_owner")
    assert not HfApi().repo_exists("org/nope")
    assert not HfApi().revision_exists("org/tiny", "nope", token="hf_owner")


def test_downloads_counts_only_the_gets_of_files(hub: HubServer, tmp_path: Path) -> None:
    hub.add_model("org/tiny", MODEL)
    HfApi().model_info("org/tiny", files_metadata=True)
    list(HfApi().list_repo_tree("org/tiny", recursive=True))
    assert hub.downloads() == 0

    hf_hub_download("org/tiny", "config.json", cache_dir=tmp_path / "c")
    assert hub.downloads() == 1
    assert [r.method for r in hub.requests()[-2:]] == ["HEAD", "GET"]
    # Again, by branch name: the client HEADs to learn the commit, finds the file, no GET.
    mark = len(hub.requests())
    hf_hub_download("org/tiny", "config.json", cache_dir=tmp_path / "c")
    assert [(r.method, r.status) for r in since(hub, mark)] == [("HEAD", 200)]
    assert hub.downloads() == 1
    # The LFS file: a HEAD answered by a redirect, then one GET on the CDN.
    hf_hub_download("org/tiny", "model.bin", cache_dir=tmp_path / "c")
    assert hub.downloads() == 2


def test_a_second_snapshot_download_downloads_nothing(hub: HubServer, tmp_path: Path) -> None:
    hub.add_model("org/tiny", MODEL)

    def fetch(where: str) -> str:
        if where == "local":
            return snapshot_download("org/tiny", local_dir=tmp_path / where)
        return snapshot_download("org/tiny", cache_dir=tmp_path / where)

    for where in ("local", "cache"):
        fetch(where)
        before, mark = hub.downloads(), len(hub.requests())
        out = fetch(where)
        assert files_in(out) == MODEL
        assert hub.downloads() == before
        # One question, to resolve main; no tree (the client cached it), no HEAD, no GET.
        assert since(hub, mark) == [HubRequest("GET", "/api/models/org/tiny/revision/main", 200)]

    # main moves on with one file changed: the client HEADs every file and fetches that one.
    changed = {**MODEL, "README.md": b"# tiny, edited\n"}
    hub.add_model("org/tiny", changed)
    before, mark = hub.downloads(), len(hub.requests())
    assert files_in(snapshot_download("org/tiny", local_dir=tmp_path / "local")) == changed
    assert hub.downloads() - before == 1
    assert sum(r.method == "HEAD" for r in since(hub, mark)) == len(MODEL)


def test_a_503_and_what_the_client_does_with_it(hub: HubServer, tmp_path: Path) -> None:
    sha = hub.add_model("org/tiny", MODEL)

    # On the repo info (snapshot_download's first call): not retried; nothing on disk, so
    # LocalEntryNotFoundError caused by the 503.
    hub.fail_next(1, 503)
    mark = len(hub.requests())
    with pytest.raises(LocalEntryNotFoundError) as info:
        snapshot_download("org/tiny", local_dir=tmp_path / "a")
    assert isinstance(info.value.__cause__, HfHubHTTPError)
    assert info.value.__cause__.response.status_code == 503
    assert since(hub, mark) == [HubRequest("GET", "/api/models/org/tiny/revision/main", 503)]
    assert files_in(snapshot_download("org/tiny", local_dir=tmp_path / "a")) == MODEL

    # On a file's HEAD: the client retries it itself and goes on.
    hub.fail_next(1, 503, method="HEAD")
    mark = len(hub.requests())
    path = hf_hub_download("org/tiny", "config.json", cache_dir=tmp_path / "b")
    assert Path(path).read_bytes() == MODEL["config.json"]
    assert [(r.method, r.status) for r in since(hub, mark)] == [
        ("HEAD", 503),
        ("HEAD", 200),
        ("GET", 200),
    ]

    # On a file's GET: raised as it is.
    hub.fail_next(1, 503, method="GET", path_contains="/resolve/")
    with pytest.raises(HfHubHTTPError) as get:
        hf_hub_download("org/tiny", "README.md", cache_dir=tmp_path / "b")
    assert get.value.response.status_code == 503

    # With a complete snapshot in the cache: the cached one is returned, no error.
    complete = snapshot_download("org/tiny", cache_dir=tmp_path / "c")
    hub.fail_next(1, 503)
    assert snapshot_download("org/tiny", cache_dir=tmp_path / "c") == complete
    assert Path(complete).name == sha

    # With a complete local_dir: returned as it is. With a file missing from it: the client
    # knows (the hub cache's refs/main names the commit, local_dir's tree cache its files) and
    # raises IncompleteSnapshotError, a LocalEntryNotFoundError.
    hub.fail_next(1, 503)
    assert files_in(snapshot_download("org/tiny", local_dir=tmp_path / "a")) == MODEL
    (tmp_path / "a/model.bin").unlink()
    hub.fail_next(1, 503)
    with pytest.raises(IncompleteSnapshotError) as incomplete:
        snapshot_download("org/tiny", local_dir=tmp_path / "a")
    assert "model.bin" in str(incomplete.value)


def test_a_cut_download_is_resumed_with_a_range(hub: HubServer, tmp_path: Path) -> None:
    big = random.Random(1).randbytes(12 * 1024 * 1024)
    hub.add_model("org/tiny", {**MODEL, "big.safetensors": big})
    # The client reads bodies in 10 MiB chunks (constants.DOWNLOAD_CHUNK_SIZE) and keeps only
    # whole chunks: cut after 10.5 MiB, it resumes from 10 MiB with a Range request (206).
    hub.cut_next(1, after_bytes=11 * 1024 * 1024 - 512 * 1024)
    path = hf_hub_download("org/tiny", "big.safetensors", cache_dir=tmp_path / "c")
    assert Path(path).read_bytes() == big
    cdn = [(r.method, r.status) for r in hub.requests() if r.path.startswith("/lfs/")]
    assert cdn == [("GET", 200), ("GET", 206)]
    assert hub.downloads() == 2  # the cut GET served bytes too

    # Cut within the first chunk: nothing was kept, so it starts over (200 again).
    hub.cut_next(1, after_bytes=100_000)
    path = hf_hub_download("org/tiny", "model.bin", cache_dir=tmp_path / "d")
    assert Path(path).read_bytes() == WEIGHTS
    assert [
        r.status for r in hub.requests() if r.path.endswith(hashlib.sha256(WEIGHTS).hexdigest())
    ] == [200, 200]


def test_listing_and_paths_info(hub: HubServer) -> None:
    sha = hub.add_model("org/tiny", MODEL)
    api = HfApi()
    assert sorted(api.list_repo_files("org/tiny")) == sorted(MODEL)
    top = {e.path: type(e).__name__ for e in api.list_repo_tree("org/tiny")}
    assert top == {"README.md": "RepoFile", "config.json": "RepoFile", "extra": "RepoFolder",
                   "model.bin": "RepoFile", "tokenizer_config.json": "RepoFile"}  # fmt: skip
    assert [e.path for e in api.list_repo_tree("org/tiny", "extra")] == ["extra/notes.txt"]
    expanded = list(api.list_repo_tree("org/tiny", expand=True))
    assert {e.last_commit.oid for e in expanded if e.last_commit is not None} == {sha}
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree("org/tiny", "nope"))

    info = {e.path: e for e in api.get_paths_info("org/tiny", ["model.bin", "extra", "nope"])}
    assert sorted(info) == ["extra", "model.bin"]
    lfs = info["model.bin"].lfs  # type: ignore[union-attr]
    assert lfs is not None and lfs.size == len(WEIGHTS)
    siblings = {
        s.rfilename: s for s in api.model_info("org/tiny", files_metadata=True).siblings or []
    }
    assert siblings["model.bin"].lfs is not None
    assert siblings["config.json"].lfs is None
    assert siblings["config.json"].size == len(MODEL["config.json"])
    assert api.model_info("org/tiny").config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
    }
    assert api.model_info("org/tiny", expand=["sha"]).siblings is None


def test_the_cdn_takes_signed_urls_without_a_token(hub: HubServer) -> None:
    hub.add_model("org/gated", MODEL, token="hf_accepted", gated=True)
    url = hf_hub_url("org/gated", "model.bin")
    meta = huggingface_hub.get_hf_file_metadata(url, token="hf_accepted")
    assert meta.location.startswith(hub.cdn_endpoint + "/lfs/models/org/gated/")
    assert (meta.size, meta.etag) == (len(WEIGHTS), meta.location.split("/")[-1].split("?")[0])
    with urllib.request.urlopen(meta.location) as answer:
        assert answer.read() == WEIGHTS
    for tampered, status in (
        (meta.location.replace("X-Signature=", "X-Signature=0"), 403),
        (meta.location.split("?")[0], 403),
    ):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(tampered)
        assert refused.value.code == status
    with_token = urllib.request.Request(meta.location, headers={"Authorization": "Bearer x"})
    with pytest.raises(urllib.error.HTTPError) as both:
        urllib.request.urlopen(with_token)
    assert both.value.code == 400


def test_hf_endpoint_alone_is_not_enough_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    with hub_server() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        # Read once, at import: the variable changes nothing in a running process.
        assert server.endpoint != constants.ENDPOINT
        assert not hf_hub_url("org/tiny", "config.json").startswith(server.endpoint)
        server.patch(monkeypatch)
        assert hf_hub_url("org/tiny", "config.json") == (
            f"{server.endpoint}/org/tiny/resolve/main/config.json"
        )
        assert HfApi().endpoint == server.endpoint
        assert server.env()["HF_ENDPOINT"] == server.endpoint


def test_transformers_autoconfig_reads_the_stand_in(hub: HubServer, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hub.add_model("org/tiny", MODEL, token="hf_owner")
    v1_files = {**MODEL, "config.json": json.dumps({**CONFIG, "hidden_size": 32}).encode()}
    v1 = hub.add_model("org/tiny", v1_files, revision="v1", token="hf_owner")

    config = transformers.AutoConfig.from_pretrained(
        "org/tiny", revision="v1", token="hf_owner", cache_dir=tmp_path / "tf"
    )
    assert (config.model_type, config.hidden_size) == ("llama", 32)
    assert (tmp_path / f"tf/models--org--tiny/snapshots/{v1}/config.json").exists()
    # transformers resolves the revision first (the repo info), then fetches by commit.
    assert [r[:2] for r in hub.requests()] == [
        ("GET", "/api/models/org/tiny/revision/v1"),
        ("HEAD", f"/org/tiny/resolve/{v1}/config.json"),
        ("GET", f"/org/tiny/resolve/{v1}/config.json"),
    ]
    # Without the token, from the same cache: the hub refuses (401), and the client falls back
    # on the copy it has, without an error.
    mark = len(hub.requests())
    again = transformers.AutoConfig.from_pretrained(
        "org/tiny", revision="v1", cache_dir=tmp_path / "tf"
    )
    assert again.hidden_size == 32
    assert {r.status for r in since(hub, mark)} == {401}
    # Without the token and with nothing cached: transformers wraps the client's error in an
    # OSError.
    with pytest.raises(OSError) as refused:
        transformers.AutoConfig.from_pretrained("org/tiny", cache_dir=tmp_path / "anon")
    assert isinstance(refused.value.__cause__, RepositoryNotFoundError)
