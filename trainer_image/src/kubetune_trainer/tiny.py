"""Tiny random-init models, a tokenizer trained on the fly, and synthetic datasets.

No hub is reachable in CI, so tests, benchmarks and end-to-end runs build their model folders
here and load them back through the trainer's real loading code. Usage:

    python -m kubetune_trainer.tiny OUT_DIR [--arch llama|qwen2] [--format alpaca] [--records N]
    python -m kubetune_trainer.tiny OUT_DIR --preference      # DPO pairs

writes OUT_DIR/model (config, safetensors, tokenizer) and OUT_DIR/data.jsonl.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "the",
    "a",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "red",
    "blue",
    "green",
    "small",
    "large",
    "fast",
    "slow",
    "cat",
    "dog",
    "bird",
    "fish",
    "tree",
    "river",
    "stone",
    "cloud",
    "model",
    "data",
    "token",
    "train",
    "learn",
    "write",
    "read",
    "answer",
    "question",
    "list",
    "sort",
    "count",
    "add",
    "sum",
    "number",
    "word",
    "letter",
    "first",
    "last",
    "next",
    "before",
    "after",
    "is",
    "are",
    "was",
    "be",
    "has",
    "have",
    "do",
    "does",
    "make",
    "give",
    "find",
    "show",
    "tell",
    "why",
    "how",
    "what",
    "which",
    "where",
]


def synthetic_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(n)]


def make_tokenizer(
    out: Path, vocab_size: int = 512, chat_template: bool = True, add_bos: bool = True
) -> Any:
    """Train a byte-level BPE on synthetic text and save it as a HF fast tokenizer.

    With add_bos it prepends `<s>` like Llama's tokenizers; without, it adds nothing like Qwen's.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    from kubetune_trainer.data import ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT

    # The prompt templates are repeated so BPE learns them as few tokens, as real tokenizers do.
    templates = [ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT, "repeat the words", "item"] * 300
    tok.train_from_iterator([*synthetic_sentences(2000), *WORDS, *templates], trainer)
    if add_bos:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    fast_cls: Any = PreTrainedTokenizerFast
    fast = fast_cls(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    if chat_template:
        fast.chat_template = CHATML
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def make_model(
    out: Path,
    *,
    arch: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int = 512,
    max_positions: int = 1024,
    seed: int = 0,
    chat_template: bool = True,
) -> Path:
    """A random-init Llama- or Qwen2-style causal LM plus tokenizer in one HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = make_tokenizer(
        out, vocab_size=vocab_size, chat_template=chat_template, add_bos=arch == "llama"
    )
    common: dict[str, Any] = {
        "vocab_size": len(tok),
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    torch.manual_seed(seed)
    model: Any
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif arch == "qwen2":
        # Qwen2's small sizes tie input and output embeddings; keep that here.
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    else:
        raise ValueError(f"unknown arch {arch!r}")
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _alpaca(rng: random.Random, i: int, long_tail: bool = False) -> dict[str, Any]:
    # long_tail: lengths spread like real instruction data (most short, a few very long).
    n = min(120, max(1, int(rng.lognormvariate(2.3, 1.0)))) if long_tail else rng.randint(2, 6)
    words = [rng.choice(WORDS) for _ in range(n)]
    rec = {"instruction": f"repeat the words {' '.join(words)}", "output": " ".join(words)}
    if i % 3 == 0:
        rec["input"] = f"item {i % 7}"
    return rec


def make_records(fmt: str, n: int, seed: int = 0, long_tail: bool = False) -> list[dict[str, Any]]:
    """n synthetic records in a dataset format (a learnable copy task)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for i in range(n):
        a = _alpaca(rng, i, long_tail)
        if fmt == "alpaca":
            out.append(a)
        elif fmt == "instruction-response":
            out.append({"instruction": a["instruction"], "response": a["output"]})
        elif fmt == "sharegpt":
            out.append(
                {
                    "conversations": [
                        {"from": "system", "value": "you copy words"},
                        {"from": "human", "value": a["instruction"]},
                        {"from": "gpt", "value": a["output"]},
                        {"from": "human", "value": "again"},
                        {"from": "gpt", "value": a["output"]},
                    ]
                }
            )
        elif fmt == "chat":
            out.append(
                {
                    "messages": [
                        {"role": "user", "content": a["instruction"]},
                        {"role": "assistant", "content": a["output"]},
                    ]
                }
            )
        elif fmt == "text":
            out.append({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))})
        else:
            raise ValueError(f"unknown format {fmt!r}")
    return out


def make_preference_records(n: int, seed: int = 0, chat: bool = False) -> list[dict[str, Any]]:
    """n synthetic DPO pairs with a learnable rule: the chosen answer copies the prompt's
    words as they are, the rejected one copies them in upper case (the format it breaks).
    With `chat`, chosen and rejected are conversations sharing the user turn."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
        prompt = f"repeat the words {' '.join(words)}"
        chosen = " ".join(words)
        rejected = chosen.upper()
        if chat:
            user = {"role": "user", "content": prompt}
            out.append(
                {
                    "chosen": [user, {"role": "assistant", "content": chosen}],
                    "rejected": [user, {"role": "assistant", "content": rejected}],
                }
            )
        else:
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kubetune_trainer.tiny")
    p.add_argument("out", type=Path)
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    p.add_argument("--format", default="alpaca")
    p.add_argument("--records", type=int, default=256)
    p.add_argument("--preference", action="store_true", help="DPO pairs instead of --format")
    args = p.parse_args(argv)
    make_model(args.out / "model", arch=args.arch)
    records = (
        make_preference_records(args.records)
        if args.preference
        else make_records(args.format, args.records)
    )
    write_jsonl(args.out / "data.jsonl", records)
    print(args.out)


if __name__ == "__main__":
    main()
