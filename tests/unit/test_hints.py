"""Hints for keys from other fine-tuning tools (api/hints.py), and `kubetune plan` giving them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from kubetune.api.hints import FOREIGN_KEYS, did_you_mean
from kubetune.api.v1alpha1 import FineTuneJobSpec
from kubetune.cli import main

pytestmark = pytest.mark.unit


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for a in get_args(annotation) if (m := _model_in(a)) is not None), None)


def spec_has(path: str) -> bool:
    model: type[BaseModel] | None = FineTuneJobSpec
    for part in path.split("."):
        if model is None:
            return False
        field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return False
        model = _model_in(field.annotation)
    return True


@pytest.mark.parametrize("key", sorted(FOREIGN_KEYS))
def test_every_hint_names_a_field_the_spec_has(key: str) -> None:
    target = FOREIGN_KEYS[key].split(" ")[0].rstrip(":")
    assert spec_has(target), f"{key} → {FOREIGN_KEYS[key]}: no spec.{target}"


def test_hints_for_other_tools_keys_and_none_for_nonsense() -> None:
    assert did_you_mean(("spec", "lora", "r")) == (
        "did you mean spec.lora.rank? (`r` is another tool's name)"
    )
    assert "spec.training.microBatchSize" in str(
        did_you_mean(("spec", "training", "per_device_train_batch_size"))
    )
    assert "spec.training.sequenceLength" in str(did_you_mean(("spec", "Sequence_Len")))
    assert did_you_mean(("spec", "training", "frobnicate")) is None
    # This API's own field in snake_case: refused by the API server, so by the CLI too.
    assert did_you_mean(("spec", "training", "learning_rate")) == (
        "did you mean `learningRate`? The API's fields are camelCase"
    )
    assert did_you_mean(("spec", "training", 0)) is None
    assert did_you_mean(()) is None


def test_plan_says_what_to_write_instead(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(
        """
apiVersion: kubetune.io/v1alpha1
kind: FineTuneJob
metadata: {name: axolotl-habits}
spec:
  model: {uri: mistralai/Mistral-7B-v0.3}
  dataset: {uri: /data/train.jsonl}
  method: lora
  lora: {r: 8}
  training: {lr: 0.0001, sequence_len: 2048, frobnicate: 1, max_steps: 10}
"""
    )
    result = CliRunner().invoke(main, ["plan", str(job)])
    assert result.exit_code != 0
    lines = result.output.splitlines()
    assert lines[1].startswith(
        "  spec.lora.r: Extra inputs are not permitted; did you mean spec.lora.rank?"
    )
    assert any("spec.training.lr:" in ln and "spec.training.learningRate" in ln for ln in lines)
    assert any("spec.training.max_steps:" in ln and "`maxSteps`" in ln for ln in lines)
    assert any(
        ln.endswith("spec.training.frobnicate: Extra inputs are not permitted") for ln in lines
    )
