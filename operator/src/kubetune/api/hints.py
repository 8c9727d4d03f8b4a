"""What to write instead: keys users bring from other fine-tuning tools.

A FineTuneJob refuses unknown keys. Most of them are the right idea under another tool's
name (Axolotl's `sequence_len`, TRL's `per_device_train_batch_size`, PEFT's `r`), or this
API's own name in snake_case. `did_you_mean` turns such a key into the field to use.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any, get_args

from pydantic import BaseModel
from pydantic.alias_generators import to_camel

# Other tools' keys → the FineTuneJob field (under spec) that does the same.
FOREIGN_KEYS: dict[str, str] = {
    # PEFT / Axolotl LoRA settings
    "r": "lora.rank",
    "lora_r": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.targetModules",
    "target_modules": "lora.targetModules",
    "bnb_4bit_use_double_quant": "lora.doubleQuant",
    # training hyperparameters (TRL / transformers TrainingArguments, Axolotl)
    "lr": "training.learningRate",
    "num_epochs": "training.epochs",
    "num_train_epochs": "training.epochs",
    "sequence_len": "training.sequenceLength",
    "max_seq_length": "training.sequenceLength",
    "max_seq_len": "training.sequenceLength",
    "seq_len": "training.sequenceLength",
    "max_length": "training.sequenceLength",
    "per_device_train_batch_size": "training.microBatchSize",
    "batch_size": "training.globalBatchSize",
    "gradient_accumulation_steps": (
        "training.globalBatchSize (= micro-batch × accumulation × data-parallel GPUs)"
    ),
    "warmup_steps": "training.warmupRatio",
    "sample_packing": "training.packing",
    "optim": "training.optimizer",
    "bf16": "training.precision",
    "fp16": "training.precision",
    # what to train and on what
    "base_model": "model.uri",
    "model_name_or_path": "model.uri",
    "datasets": "dataset.uri",
    "dataset_name": "dataset.uri",
    "adapter": "method (lora or qlora)",
    "load_in_4bit": "method: qlora",
    "load_in_8bit": "method: lora (8-bit base weights are not offered; qlora is 4-bit)",
    "output_dir": "output.uri",
    "num_gpus": "resources.gpus",
}


def did_you_mean(loc: Sequence[str | int]) -> str | None:
    """A hint for the unknown key at the end of `loc` (pydantic's error location, e.g.
    `("spec", "training", "lr")`): this API's name for it, or None when there is none."""
    if not loc or not isinstance(loc[-1], str):
        return None
    key = loc[-1]
    camel = to_camel(key)
    if camel != key and camel in _api_keys():
        return f"did you mean `{camel}`? The API's fields are camelCase"
    target = FOREIGN_KEYS.get(key) or FOREIGN_KEYS.get(key.lower())
    if target is None:
        return None
    return f"did you mean spec.{target}? (`{key}` is another tool's name)"


@cache
def _api_keys() -> frozenset[str]:
    """Every field name (camelCase) of a FineTuneJob, at any depth."""
    from kubetune.api.v1alpha1 import FineTuneJob

    keys: set[str] = set()
    todo: list[type[BaseModel]] = [FineTuneJob]
    while todo:
        model = todo.pop()
        for name, field in model.model_fields.items():
            keys.add(field.alias or name)
            todo.extend(m for m in _models_in(field.annotation) if m not in todo)
    return frozenset(keys)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]
