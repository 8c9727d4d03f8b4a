"""Dataset reading, formatting, tokenization, packing and the resumable batch order.

Everything happens up front, before the model is loaded: a bad record fails the run in
seconds with the file, the line and what is wrong, not an hour into training.

Records become `Example`s (token ids plus labels with the prompt masked to -100), then rows:
with packing, examples are laid end to end into rows of exactly `sequence_length` tokens whose
`position_ids` restart at every example, which transformers turns into a block-diagonal
attention mask (or `kubetune_trainer.attention` into document bounds for a variable-length
kernel), so packed examples never attend to each other. Without packing, each example
is a row and a micro-batch is padded to its longest row.

The batch order is a pure function of (seed, epoch, rows consumed in the epoch), so the
checkpoint stores two integers and a resumed run sees exactly the rows it would have seen.

The modules: `records` (reading files and hub datasets into records), `formats` (the SFT
formats into examples), `prepare` (examples into rows: fitting, packing, the validation
split), `pairs` (DPO's preference records into pairs of rows), `batches` (rows into batches,
in the resumable order), and `rows` (the shapes they share).
"""

from __future__ import annotations

from kubetune_trainer.data.batches import (
    Batch,
    DataPosition,
    StepBatches,
    collate,
    collate_pairs,
    eval_batches,
)
from kubetune_trainer.data.formats import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_WITH_INPUT,
    CHAT_ROLES,
    DEFAULT_CHAT_TEMPLATE,
    SHAREGPT_ROLES,
    ensure_chat_template,
    record_to_example,
    renders_chat,
)
from kubetune_trainer.data.pairs import (
    PREFERENCE_KEYS,
    pair_rows,
    prepare_preference_data,
    record_to_pair,
    truncate_pair,
)
from kubetune_trainer.data.prepare import MAX_ERRORS_SHOWN, pack, prepare_data
from kubetune_trainer.data.records import HUB_TOKEN_ENV, Record, read_records
from kubetune_trainer.data.records import _files as _files
from kubetune_trainer.data.rows import (
    IGNORE_INDEX,
    DataStats,
    Example,
    Pair,
    PairRows,
    PreparedData,
    Ragged,
    Rows,
)

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_WITH_INPUT",
    "CHAT_ROLES",
    "DEFAULT_CHAT_TEMPLATE",
    "HUB_TOKEN_ENV",
    "IGNORE_INDEX",
    "MAX_ERRORS_SHOWN",
    "PREFERENCE_KEYS",
    "SHAREGPT_ROLES",
    "Batch",
    "DataPosition",
    "DataStats",
    "Example",
    "Pair",
    "PairRows",
    "PreparedData",
    "Ragged",
    "Record",
    "Rows",
    "StepBatches",
    "collate",
    "collate_pairs",
    "ensure_chat_template",
    "eval_batches",
    "pack",
    "pair_rows",
    "prepare_data",
    "prepare_preference_data",
    "read_records",
    "record_to_example",
    "record_to_pair",
    "renders_chat",
    "truncate_pair",
]
