"""Checking what was fetched, and measuring the dataset, with the trainer's own code.

The model: its config.json parses (and names the architecture the plan assumed), its
tokenizer loads. The dataset: `data.read_records` reads it (a line that is not JSON fails
here, before the model is fetched), then `data.prepare_data` formats, templates, tokenizes,
splits and packs it exactly as training will (`data.prepare_preference_data` for DPO's
preference pairs), which both checks every record and gives the counts the operator plans
with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetune_trainer.contract import StageInConfig, TrainingConfig
from kubetune_trainer.data import Record, prepare_data, prepare_preference_data, read_records
from kubetune_trainer.errors import ConfigError, DataError

DEFAULT_SEED = int(TrainingConfig.model_fields["seed"].default)
"""The seed the split and the packing order use. StageInConfig carries none, so the counts are
those of a job with the default seed. For another seed, examples are the same; tokens are the
same when validation_split is 0 (otherwise other examples are held out: about 1% apart on
2,000 long-tailed records); packed sequences depend on the order examples are laid end to
end (about 1-2% apart there)."""


Renames = tuple[str, str] | None
"""(the cache's path of a dataset, what to call it in messages: its source), or None."""


def read_dataset(path: str, *, uri: str, renames: Renames) -> list[Record]:
    """Every record of the dataset at `path`; a bad file or line is a DataError naming it."""
    try:
        return read_records(path, "path")
    except DataError as e:
        raise DataError(_data_message(str(e), uri, renames)) from e


def _data_message(message: str, uri: str, renames: Renames) -> str:
    text = message.replace(*renames) if renames else message
    if not text.startswith(uri):
        text = f"dataset {uri}: {text}"
    if "to fix" not in text.lower():
        text += f". To fix: correct or remove what is named above in {uri}"
    return text


def check_config(path: str, *, uri: str, model_type: str | None) -> dict[str, Any]:
    """The model's config.json, parsed, naming `model_type` when that is given."""
    config_file = Path(path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"model {uri}: no config.json. To fix: point model.uri at a Hugging Face model "
            "folder (config.json, *.safetensors, tokenizer files)"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"model {uri}: config.json is not readable JSON ({e}). To fix: repair it"
        ) from e
    if not isinstance(config, dict):
        raise ConfigError(f"model {uri}: config.json is not a JSON object. To fix: repair it")
    found = config.get("model_type")
    if model_type is not None and found != model_type:
        raise ConfigError(
            f"model {uri}: config.json says model_type {found!r}, the plan assumed "
            f"{model_type!r}. To fix: point model.uri at a {model_type} model, or plan the job "
            f"again for this {found} model"
        )
    return config


def check_model(path: str, *, uri: str, model_type: str | None) -> tuple[dict[str, Any], Any]:
    """config.json (parsed) and the tokenizer, or a ConfigError saying what is wrong."""
    config = check_config(path, uri=uri, model_type=model_type)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        first = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"model {uri}: its tokenizer does not load ({type(e).__name__}: {first}). To fix: "
            "add the tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json)"
        ) from e
    if tokenizer.pad_token_id is None:  # as modeling.load_tokenizer
        tokenizer.pad_token = tokenizer.eos_token
    return config, tokenizer


@dataclass(frozen=True)
class Measured:
    examples: int
    tokens: int
    packed_sequences: int


def measure(
    records: list[Record],
    cfg: StageInConfig,
    tokenizer: Any,
    *,
    renames: Renames,
) -> Measured:
    """Training-split examples, their tokens as templated, and the rows one epoch makes. For
    DPO (`cfg.objective`) an example is a preference pair, its tokens those of both sides
    (the prompt twice), and a pair one row of each side: never packed."""
    try:
        if cfg.objective == "dpo":
            prepared = prepare_preference_data(
                records,
                tokenizer=tokenizer,
                sequence_length=cfg.sequence_length,
                validation_split=cfg.dataset.validation_split,
                seed=DEFAULT_SEED,
            )
        else:
            prepared = prepare_data(
                records,
                fmt=cfg.dataset.format,
                tokenizer=tokenizer,
                sequence_length=cfg.sequence_length,
                packing=cfg.packing,
                validation_split=cfg.dataset.validation_split,
                seed=DEFAULT_SEED,
            )
    except DataError as e:
        raise DataError(_data_message(str(e), cfg.dataset.source, renames)) from e
    stats = prepared.stats
    return Measured(
        examples=stats.train_examples,
        tokens=stats.train_tokens,
        packed_sequences=stats.train_rows,
    )
