"""The run's output: the adapter (PEFT safetensors) and, if asked, the merged model, or the
full model; with `trainer_summary.json` beside them. Rank 0 writes; every rank gathers."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kubetune_trainer.bnb import import_bitsandbytes
from kubetune_trainer.contract import TrainerConfig
from kubetune_trainer.distributed import DistEnv, barrier
from kubetune_trainer.modeling import BuiltModel, from_hub, model_source

log = logging.getLogger(__name__)


def write_output(
    cfg: TrainerConfig,
    env: DistEnv,
    model: nn.Module,
    built: BuiltModel,
    tokenizer: Any,
    summary: dict[str, Any],
) -> Path:
    """Write the output of `model` to `output.dir`, `summary` as its trainer_summary.json.
    Every rank calls it: the full state dict is gathered from all of them."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    out = Path(cfg.output.dir)
    core: Any = built.core
    full = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=built.adapter_only
    )
    sd = get_model_state_dict(model, options=full)
    if built.adapter_only:
        if env.is_main:
            adapter_dir = out / "adapter"
            core.save_pretrained(str(adapter_dir), state_dict=sd, safe_serialization=True)
            tokenizer.save_pretrained(str(adapter_dir))
            if cfg.output.merge_adapter:
                _merge(cfg, tokenizer, adapter_dir, out / "merged")
    elif env.is_main:
        _save_full(built, tokenizer, sd, out / "model")
    barrier()
    if env.is_main:
        (out / "trainer_summary.json").write_text(json.dumps(summary, indent=2))
        readable_by_all(out)
    return out


def _merge(cfg: TrainerConfig, tokenizer: Any, adapter_dir: Path, merged_dir: Path) -> None:
    """Merge into a freshly loaded full-precision base (for QLoRA: not the 4-bit one)."""
    import_bitsandbytes()  # peft imports it where it is installed
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    src, kwargs = model_source(cfg)
    base = from_hub(
        cfg,
        "model",
        lambda: AutoModelForCausalLM.from_pretrained(src, dtype="auto", **kwargs),
    )
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.config.use_cache = True
    merged.save_pretrained(str(merged_dir), safe_serialization=True)
    # The chat template goes into tokenizer_config.json, not chat_template.jinja: TGI reads
    # it only there; transformers, vLLM and llama.cpp's converter read it there too.
    tokenizer.save_pretrained(str(merged_dir), save_jinja_files=False)
    log.info("merged model written to %s", merged_dir)


def _save_full(built: BuiltModel, tokenizer: Any, sd: dict[str, Any], model_dir: Path) -> None:
    import transformers

    auto_model: Any = transformers.AutoModelForCausalLM

    config = built.hf_config
    config.use_cache = True
    with torch.device("meta"):
        clean = auto_model.from_config(config)
    clean.load_state_dict(sd, assign=True, strict=False)
    clean.tie_weights()
    clean.save_pretrained(str(model_dir), safe_serialization=True)
    # As for merged/: the chat template in tokenizer_config.json, where TGI reads it.
    tokenizer.save_pretrained(str(model_dir), save_jinja_files=False)
    log.info("model written to %s", model_dir)


def readable_by_all(folder: Path) -> None:
    """Give the output the modes the process's umask allows (0644 and 0755 under the usual
    022): safetensors writes its files 0600, which a serving pod running as another user
    (vLLM, TGI, KServe reading the claim) could not open."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        mode = (0o777 if path.is_dir() else 0o666) & ~umask
        path.chmod(path.stat().st_mode & 0o7000 | mode)
