"""The hub: `huggingface_hub.snapshot_download`, only what training reads (a model's config,
tokenizer, chat template and safetensors weights; a dataset's data files of the train split).
Failures are sorted by `kubetune_trainer.hub`: refused or missing is permanent; 429, 5xx and
timeouts are retried, then transient."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any

from kubetune_trainer.contract import DATA_SUFFIXES as SUFFIXES
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.hub import hub_call
from kubetune_trainer.stagein.fetch.base import Fetched, Progress, T, _no_room, prune

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",  # sentencepiece
    "*.tiktoken",
    "chat_template.json",
    "chat_template.jinja",
    "additional_chat_templates/*.jinja",
    "*.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
"""What training reads from a model repository besides the weights (top level only; no
`original/`, `onnx/`, `gguf` copies)."""
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
DATASET_METADATA = frozenset({"dataset_info.json", "dataset_infos.json", "state.json"})
_SPLIT_WORDS = {
    "train": ("train", "training"),
    "other": ("test", "testing", "eval", "evaluation", "validation", "valid", "val", "dev"),
}


def _matches(path: str, pattern: str) -> bool:
    return path.count("/") == pattern.count("/") and fnmatch(path, pattern)


def _split_of(path: str) -> str | None:
    words = re.split(r"[/_.\-\s]+", path.lower())
    for split, names in _SPLIT_WORDS.items():
        if any(w in names for w in words):
            return split
    return None


def select_model_files(files: dict[str, int]) -> list[str]:
    """The repository's small files a run reads (config, tokenizer, template, indexes)."""
    return sorted(p for p in files if any(_matches(p, pat) for pat in MODEL_FILES))


def select_weights(files: dict[str, int], dest: Path, what: str, uri: str) -> list[str]:
    """The weight files: the shards a safetensors index names, the single safetensors file,
    else every top-level one; only without safetensors the PyTorch `.bin` files."""
    for index, suffix in ((SAFETENSORS_INDEX, ".safetensors"), (BIN_INDEX, ".bin")):
        if index in files:
            try:
                weight_map = json.loads((dest / index).read_text())["weight_map"]
                shards = sorted({str(v) for v in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(
                    f"{what} {uri}: {index} is not a weight index ({e}). To fix: repair the "
                    "repository's index, or point model.uri at another revision"
                ) from e
            missing = [s for s in shards if s not in files]
            if missing:
                raise ConfigError(
                    f"{what} {uri}: {index} names shards the repository lacks ({missing[:3]}). "
                    "To fix: upload them, or point model.uri at another revision"
                )
            if suffix == ".safetensors" or not any(p.endswith(".safetensors") for p in files):
                return shards
    top = [p for p in files if "/" not in p]
    if "model.safetensors" in files:
        return ["model.safetensors"]
    safetensors = sorted(p for p in top if p.endswith(".safetensors"))
    if safetensors:
        return safetensors
    if "pytorch_model.bin" in files:
        return ["pytorch_model.bin"]
    raise ConfigError(
        f"{what} {uri}: no weights in the repository (looked for *.safetensors and "
        "pytorch_model.bin at the top level). To fix: point model.uri at a Hugging Face "
        "model repository with safetensors weights"
    )


def select_dataset_files(files: dict[str, int], what: str, uri: str) -> list[str]:
    """The data files the trainer reads (`contract.DATA_SUFFIXES`): of the train split only
    when file or folder names say which split a file is (as `load_dataset(split="train")`
    reads)."""
    data = [
        p
        for p in files
        if PurePosixPath(p).suffix in SUFFIXES
        and PurePosixPath(p).name not in DATASET_METADATA
        and not any(part.startswith(".") for part in PurePosixPath(p).parts)
    ]
    if not data:
        raise ConfigError(
            f"{what} {uri}: no data files in the repository (looked for "
            f"{', '.join(SUFFIXES)}). To fix: point dataset.uri at a dataset with JSONL, JSON, "
            "Parquet or text files"
        )
    train = [p for p in data if _split_of(p) == "train"]
    return sorted(train if train else [p for p in data if _split_of(p) is None] or data)


HUB_ARRIVING = "<hub downloads in progress>"
"""The `Progress.in_flight` name of the bytes in the hub client's `.incomplete` files."""


class _Watch:
    """Reports the files a hub download finishes: the client renames each into place whole,
    so a file at its final path is done; until then it grows in an `.incomplete` file under
    `dest/.cache/huggingface/download/` (counted as arriving, at most what is pending)."""

    def __init__(self, dest: Path, files: dict[str, int], progress: Progress) -> None:
        self.dest = dest
        self.pending = dict(files)
        self.progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stagein-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.scan()

    def scan(self) -> None:
        for name, size in list(self.pending.items()):
            if (self.dest / name).is_file():
                del self.pending[name]
                self.progress.done(name, size)
        arriving = 0
        for part in (self.dest / ".cache" / "huggingface" / "download").rglob("*.incomplete"):
            with contextlib.suppress(OSError):  # renamed into place meanwhile
                arriving += part.stat().st_size
        self.progress.moving(HUB_ARRIVING, min(arriving, sum(self.pending.values())))

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            self.scan()
        self.progress.moving(HUB_ARRIVING, 0)


@dataclass(frozen=True)
class _HubCalls:
    """`hub_call` for one repository: its failures sorted, a full volume a ConfigError."""

    what: str
    repo_id: str
    field: str
    revision: str | None
    token_env: str | None

    def __call__(self, fn: Callable[[], T]) -> T:
        try:
            return hub_call(
                fn,
                what=self.what,
                uri=self.repo_id,
                field=self.field,
                revision=self.revision,
                token_env=self.token_env,
            )
        except OSError as e:
            room = _no_room(e, self.what, self.repo_id)
            if room is None:
                raise
            raise room from e


@dataclass(frozen=True)
class _Snapshot:
    """A repository at one commit, whose `files` (path → size) arrive in `dest` in rounds."""

    hub: Any
    repo_id: str
    repo_type: str
    commit: str
    token: str | None
    files: dict[str, int]
    dest: Path
    progress: Progress
    call: _HubCalls

    def fetch(self, names: list[str]) -> None:
        """Count `names` in and download those a previous try did not finish."""
        self.progress.expect(len(names), sum(self.files[n] for n in names))
        todo = {n: self.files[n] for n in names if not self._complete(n)}
        for name in names:
            if name not in todo:
                self.progress.done(name, self.files[name], downloaded=False)  # a previous try's
        if not todo:
            return
        with _Watch(self.dest, todo, self.progress):
            self.call(lambda: self._download(list(todo)))

    def _complete(self, name: str) -> bool:
        path = self.dest / name
        return path.is_file() and path.stat().st_size == self.files[name]

    def _download(self, names: list[str]) -> None:
        self.hub.snapshot_download(
            self.repo_id,
            repo_type=self.repo_type,
            revision=self.commit,
            token=self.token,
            local_dir=str(self.dest),
            cache_dir=str(self.dest / ".cache" / "kubetune-hf"),
            allow_patterns=[_glob_escape(n) for n in names],
        )
        # The client returns a non-empty local_dir as it is when the hub cannot be asked.
        missing = [n for n in names if not self._complete(n)]
        if missing:
            raise ConnectionError(f"the download stopped short of {missing[:3]}")


def fetch_hub(
    repo_id: str,
    *,
    repo_type: str,
    revision: str | None,
    token: str | None,
    token_env: str | None,
    field: str,
    what: str,
    dest: Path,
    progress: Progress,
    early: Callable[[Path], None] | None = None,
) -> Fetched:
    """Download what training reads of a hub repository into `dest`; a model's `early`
    check runs once its config.json is in, before the weights are fetched."""
    import huggingface_hub
    from huggingface_hub.hf_api import RepoFile

    hub: Any = huggingface_hub
    api = hub.HfApi(token=token)
    call = _HubCalls(what, repo_id, field, revision, token_env)

    def listing() -> tuple[str, dict[str, int]]:
        info = api.repo_info(repo_id, repo_type=repo_type, revision=revision)
        tree = api.list_repo_tree(repo_id, repo_type=repo_type, revision=info.sha, recursive=True)
        return str(info.sha), {f.path: int(f.size) for f in tree if isinstance(f, RepoFile)}

    commit, files = call(listing)
    snapshot = _Snapshot(hub, repo_id, repo_type, commit, token, files, dest, progress, call)
    if repo_type == "model":
        small = select_model_files(files)
        snapshot.fetch(small)
        if early is not None:
            early(dest)
        weights = select_weights(files, dest, what, repo_id)
        snapshot.fetch(weights)
        fetched = {*small, *weights}
    else:
        names = select_dataset_files(files, what, repo_id)
        snapshot.fetch(names)
        fetched = set(names)
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # the client's bookkeeping
    prune(dest, fetched)
    return Fetched(commit=commit)


def hub_commit(
    repo_id: str,
    *,
    repo_type: str,
    revision: str | None,
    token: str | None,
    token_env: str | None,
    field: str,
    what: str,
) -> str:
    """The commit `revision` (None: the default branch) names now: one repo_info call."""
    import huggingface_hub

    hub: Any = huggingface_hub
    api = hub.HfApi(token=token)
    call = _HubCalls(what, repo_id, field, revision, token_env)
    return str(call(lambda: api.repo_info(repo_id, repo_type=repo_type, revision=revision).sha))


def check_hub_access(
    repo_id: str,
    *,
    repo_type: str,
    commit: str | None,
    path: str,
    token: str | None,
    token_env: str | None,
    field: str,
    what: str,
) -> None:
    """Whether this job's token may read `path` of the repository (a HEAD, no download): a
    gated or private repository in the cache is not served to a job that could not fetch it."""
    import huggingface_hub

    hub: Any = huggingface_hub
    url = hub.hf_hub_url(repo_id, path, repo_type=repo_type, revision=commit)
    hub_call(
        lambda: hub.get_hf_file_metadata(url, token=token),
        what=what,
        uri=repo_id,
        field=field,
        revision=commit,
        token_env=token_env,
    )


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)
