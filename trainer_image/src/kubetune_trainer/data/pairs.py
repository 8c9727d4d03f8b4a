"""Preference pairs for DPO.

DPO (`training.objective: dpo`) reads preference records instead of the SFT formats: the
record's shape decides, as TRL reads them, and `dataset.format` is not consulted.

* standard: `prompt`, `chosen`, `rejected` strings. The prompt is tokenized with the
  tokenizer's special tokens (BOS), each response after it with EOS appended.
* chat: `chosen` and `rejected` message lists sharing a prefix (the conversation so far),
  or a `prompt` message list with `chosen`/`rejected` holding the answer turns. The prompt
  is the shared prefix rendered with the chat template and its generation prompt; a response
  is what the template renders after it for that side (end-of-turn token included).

Pairs are never packed: the loss compares a chosen row with its rejected row, both after the
same prompt, so the two must stay side by side, and a row's log-probability is summed over
one response only. A micro-batch of B pairs is 2B padded rows: chosen 0..B-1, then rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kubetune_trainer.data.formats import CHAT_ROLES, _str_field, ensure_chat_template
from kubetune_trainer.data.prepare import _BadRecords, _split
from kubetune_trainer.data.records import Record
from kubetune_trainer.data.rows import (
    IGNORE_INDEX,
    DataStats,
    Pair,
    PairRows,
    PreparedData,
    Rows,
)
from kubetune_trainer.errors import ConfigError, DataError

PREFERENCE_KEYS = ("prompt", "chosen", "rejected")


def _conversation(record: Record, key: str, value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{record.where}: preference field {key!r} must be a non-empty list")
    out = []
    for i, turn in enumerate(value):
        role = turn.get("role") if isinstance(turn, dict) else None
        content = turn.get("content") if isinstance(turn, dict) else None
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise DataError(
                f"{record.where}: {key}[{i}] must be {{role, content}} with role in "
                f"{sorted(CHAT_ROLES)} and string content"
            )
        out.append({"role": str(role), "content": content})
    return out


def record_to_pair(record: Record, tokenizer: Any) -> Pair:
    """One preference record as token ids (see the module docstring for the two shapes)."""
    obj = record.value
    if not isinstance(obj, dict) or "chosen" not in obj or "rejected" not in obj:
        found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(
            f"{record.where}: preference record needs 'chosen' and 'rejected' (and 'prompt' "
            f"unless they are conversations sharing a prefix) (found {found})"
        )
    if isinstance(obj["chosen"], str) or isinstance(obj["rejected"], str):
        prompt = _str_field(record, "prompt", required=True, fmt="preference")
        chosen = _str_field(record, "chosen", required=True, fmt="preference")
        rejected = _str_field(record, "rejected", required=True, fmt="preference")
        p = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        c = [*tokenizer(chosen, add_special_tokens=False)["input_ids"], *eos]
        r = [*tokenizer(rejected, add_special_tokens=False)["input_ids"], *eos]
        return Pair(p, c, r)
    chosen_msgs = _conversation(record, "chosen", obj["chosen"])
    rejected_msgs = _conversation(record, "rejected", obj["rejected"])
    if "prompt" in obj:
        prefix = _conversation(record, "prompt", obj["prompt"])
        chosen_msgs, rejected_msgs = prefix + chosen_msgs, prefix + rejected_msgs
    else:
        n = 0
        while n < min(len(chosen_msgs), len(rejected_msgs)) and chosen_msgs[n] == rejected_msgs[n]:
            n += 1
        prefix = chosen_msgs[:n]
    if not prefix or len(chosen_msgs) == len(prefix) or len(rejected_msgs) == len(prefix):
        raise DataError(
            f"{record.where}: chosen and rejected must share a non-empty prompt and each add "
            "at least one turn after it"
        )

    def render(msgs: list[dict[str, str]], gen: bool) -> str:
        return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))

    prompt_text = render(prefix, True)
    pieces = []
    for side, msgs in (("chosen", chosen_msgs), ("rejected", rejected_msgs)):
        text = render(msgs, False)
        if not text.startswith(prompt_text):
            raise DataError(
                f"{record.where}: the chat template does not render the {side} conversation "
                "as its prompt followed by the response, so the response cannot be located"
            )
        pieces.append(text[len(prompt_text) :])
    p = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    c = list(tokenizer(pieces[0], add_special_tokens=False)["input_ids"])
    r = list(tokenizer(pieces[1], add_special_tokens=False)["input_ids"])
    return Pair(p, c, r)


def truncate_pair(pair: Pair, seq_len: int) -> tuple[Pair, bool]:
    """Fit prompt + longer response into `seq_len`: the prompt keeps its last
    max(seq_len - longest response, seq_len // 2) tokens (a long prompt never squeezes the
    responses below half the row), then each response keeps its first tokens up to the room
    left. Returns the pair and whether anything was cut."""
    longest = max(len(pair.chosen), len(pair.rejected))
    if len(pair.prompt) + longest <= seq_len:
        return pair, False
    keep_prompt = min(len(pair.prompt), max(seq_len - longest, seq_len // 2))
    prompt = pair.prompt[len(pair.prompt) - keep_prompt :]
    room = seq_len - len(prompt)
    return Pair(prompt, pair.chosen[:room], pair.rejected[:room]), True


def _side_rows(pairs: Sequence[Pair], side: str) -> Rows:
    ids, labels = [], []
    for pair in pairs:
        response: list[int] = getattr(pair, side)
        ids.append([*pair.prompt, *response])
        labels.append([IGNORE_INDEX] * len(pair.prompt) + response)
    return Rows(input_ids=ids, labels=labels, lengths=[len(x) for x in ids])


def pair_rows(pairs: Sequence[Pair]) -> PairRows:
    return PairRows(chosen=_side_rows(pairs, "chosen"), rejected=_side_rows(pairs, "rejected"))


def prepare_preference_data(
    records: Sequence[Record],
    *,
    tokenizer: Any,
    sequence_length: int,
    validation_split: float,
    seed: int,
) -> PreparedData:
    """`prepare_data` for DPO: validate and tokenize every pair, truncate, split, no packing."""
    if not 0.0 <= validation_split < 1.0:
        raise ConfigError(f"dataset.validation_split {validation_split} must be in [0, 1)")
    if sequence_length < 4:
        raise ConfigError(f"training.sequence_length {sequence_length} must be at least 4")
    stats = DataStats(records=len(records))
    if ensure_chat_template(tokenizer):
        stats.notes.append("tokenizer has no chat template; using ChatML for chat pairs")
    pairs: list[Pair] = []
    bad = _BadRecords()
    for record in records:
        try:
            pair = record_to_pair(record, tokenizer)
        except DataError as e:
            bad.add(e)
            continue
        pair, cut = truncate_pair(pair, sequence_length)
        stats.truncated += int(cut)
        if not pair.chosen or not pair.rejected or pair.chosen == pair.rejected:
            stats.dropped_no_target += 1  # nothing to prefer: the loss would be constant
            continue
        pairs.append(pair)
    bad.raise_if_any("the preference dataset")
    if not pairs:
        raise DataError(
            f"no usable preference pairs: {len(records)} record(s), {stats.dropped_no_target} "
            "with identical or empty responses within sequence_length"
        )
    stats.examples = len(pairs)
    train, val = _split(pairs, validation_split, seed, "pairs")
    stats.train_examples = len(train)
    stats.train_rows = len(train)
    stats.validation_rows = len(val)
    stats.train_tokens = sum(len(p.prompt) * 2 + len(p.chosen) + len(p.rejected) for p in train)
    return PreparedData(
        train=pair_rows(train), validation=pair_rows(val) if val else None, stats=stats
    )
