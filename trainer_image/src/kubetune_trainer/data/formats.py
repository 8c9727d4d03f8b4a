"""The SFT dataset formats: a record becomes an `Example`, token ids with the prompt masked
out of the labels (alpaca, instruction-response, sharegpt, chat through the tokenizer's chat
template; plain text trains on every token)."""

from __future__ import annotations

from typing import Any

from kubetune_trainer.data.records import Record
from kubetune_trainer.data.rows import IGNORE_INDEX, Example
from kubetune_trainer.errors import ConfigError, DataError

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
# Used when a tokenizer ships no chat template (base models): ChatML, as Qwen and many others.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
CHAT_ROLES = {"system", "user", "assistant", "tool"}


def _str_field(record: Record, name: str, *, required: bool, fmt: str) -> str:
    obj = record.value
    value = obj.get(name) if isinstance(obj, dict) else None
    if value is None:
        if required:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(
                f"{record.where}: {fmt} record needs a string field {name!r} (found {keys})"
            )
        return ""
    if not isinstance(value, str):
        raise DataError(
            f"{record.where}: {fmt} field {name!r} must be a string, got {type(value).__name__}"
        )
    if required and not value.strip():
        raise DataError(f"{record.where}: {fmt} field {name!r} is empty")
    return value


def _messages(record: Record, fmt: str) -> list[dict[str, str]]:
    obj = record.value
    if not isinstance(obj, dict):
        raise DataError(f"{record.where}: {fmt} record must be an object")
    if fmt == "sharegpt":
        turns = obj.get("conversations")
        key, role_key, content_key = "conversations", "from", "value"
        if turns is None and "messages" in obj:  # many "sharegpt" files use chat keys
            turns, key, role_key, content_key = obj["messages"], "messages", "role", "content"
    else:
        turns = obj.get("messages")
        key, role_key, content_key = "messages", "role", "content"
        if turns is None and "conversations" in obj:
            turns, key, role_key, content_key = (
                obj["conversations"],
                "conversations",
                "from",
                "value",
            )
    if not isinstance(turns, list) or not turns:
        raise DataError(
            f"{record.where}: {fmt} record needs a non-empty list {key!r} (found {sorted(obj)})"
        )
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{record.where}: {key}[{i}] must be an object")
        role = turn.get(role_key)
        content = turn.get(content_key)
        mapped = SHAREGPT_ROLES.get(str(role)) if role_key == "from" else role
        if mapped not in CHAT_ROLES:
            raise DataError(f"{record.where}: {key}[{i}].{role_key} {role!r} is not a known role")
        if not isinstance(content, str):
            raise DataError(f"{record.where}: {key}[{i}].{content_key} must be a string")
        out.append({"role": str(mapped), "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{record.where}: conversation has no assistant turn to learn from")
    return out


def _chat_segments(
    tokenizer: Any, messages: list[dict[str, str]], where: str
) -> list[tuple[str, bool]]:
    """Split a rendered conversation into (text, trainable) pieces; assistant turns train."""

    def render(msgs: list[dict[str, str]], gen: bool) -> str:
        return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))

    full = render(messages, False)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], True)) if i else 0
        end = len(render(messages[: i + 1], False))
        prefix = render(messages[: i + 1], False)
        if not full.startswith(prefix) or start < pos or end < start:
            raise DataError(
                f"{where}: the tokenizer's chat template does not render conversations "
                "incrementally, so assistant turns cannot be located for loss masking"
            )
        segments.append((full[pos:start], False))
        segments.append((full[start:end], True))
        pos = end
    segments.append((full[pos:], False))
    return [(t, trainable) for t, trainable in segments if t]


def _tokenize_pair(tokenizer: Any, prompt: str, response: str) -> Example:
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        r = [*r, tokenizer.eos_token_id]
    return Example(input_ids=[*p, *r], labels=[IGNORE_INDEX] * len(p) + list(r))


def record_to_example(record: Record, fmt: str, tokenizer: Any) -> Example:
    if fmt == "alpaca":
        instruction = _str_field(record, "instruction", required=True, fmt=fmt)
        inp = _str_field(record, "input", required=False, fmt=fmt)
        output = _str_field(record, "output", required=True, fmt=fmt)
        template = ALPACA_PROMPT_WITH_INPUT if inp.strip() else ALPACA_PROMPT
        return _tokenize_pair(
            tokenizer, template.format(instruction=instruction, input=inp), output
        )
    if fmt == "instruction-response":
        obj = record.value if isinstance(record.value, dict) else {}
        ikey = "instruction" if "instruction" in obj or "prompt" not in obj else "prompt"
        rkey = "response" if "response" in obj or "completion" not in obj else "completion"
        instruction = _str_field(record, ikey, required=True, fmt=fmt)
        response = _str_field(record, rkey, required=True, fmt=fmt)
        system = _str_field(record, "system", required=False, fmt=fmt)
        messages = [{"role": "system", "content": system}] if system else []
        messages += [
            {"role": "user", "content": instruction},
            {"role": "assistant", "content": response},
        ]
        return _chat_example(tokenizer, messages, record.where)
    if fmt in ("sharegpt", "chat"):
        return _chat_example(tokenizer, _messages(record, fmt), record.where)
    if fmt == "text":
        text = _str_field(record, "text", required=True, fmt=fmt)
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = [*ids, tokenizer.eos_token_id]
        return Example(input_ids=list(ids), labels=list(ids))
    raise ConfigError(f"unknown dataset format {fmt!r}")


def _chat_example(tokenizer: Any, messages: list[dict[str, str]], where: str) -> Example:
    ids: list[int] = []
    labels: list[int] = []
    for text, trainable in _chat_segments(tokenizer, messages, where):
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(seg)
        labels.extend(seg if trainable else [IGNORE_INDEX] * len(seg))
    return Example(input_ids=ids, labels=labels)


def renders_chat(fmt: str) -> bool:
    """Whether records of `fmt` go through the tokenizer's chat template."""
    return fmt in ("sharegpt", "chat", "instruction-response")


def ensure_chat_template(tokenizer: Any) -> bool:
    """Give template-less tokenizers ChatML; returns True when it did."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return True
