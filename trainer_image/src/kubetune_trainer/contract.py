"""The versioned JSON contract between the operator and the trainer.

The operator renders a `TrainerConfig` into a ConfigMap; the trainer reads it from the
file named by `--config` (or `$KUBETUNE_CONFIG`). This module depends on pydantic only and
does no I/O, so the operator's pure core can import it without torch, and the trainer without
Kubernetes.

Bump `CONTRACT_VERSION` on any incompatible change; the trainer refuses versions it does
not know with a message that names both. The results the pods leave in their termination
messages (`TrainerResult`, `StageInResult`, `StageOutResult`, `ExportResult`) are part of it.
"""

from __future__ import annotations

import json
import re
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

CONTRACT_VERSION = 2
"""2: the trainer's result is a `TrainerResult` (JSON) in its termination message, where 1
wrote `key=value` words (`early_stopped step=...`, `oom peak_gib=...`); the operator still
reads those from pods of version 1 trainers."""

# The words operator and trainer share. The operator's API (kubetune.api.v1alpha1), its
# estimator, planner and CLI import these; nothing defines them a second time.
Method = Literal["full", "lora", "qlora"]
"""Full fine-tuning, LoRA adapters on bf16 weights, or LoRA adapters on NF4 weights."""
Precision = Literal["bf16", "amp-bf16", "fp32"]
"""`bf16`: bf16 weights, gradients and optimizer states; `amp-bf16`: fp32 master weights with
bf16 compute; `fp32`: everything in fp32."""
Optimizer = Literal["adamw", "adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit"]
"""AdamW (torch, fused on GPU), or bitsandbytes' AdamW with 8-bit states, paged 8-bit
states, or paged 32-bit states (paged states live in CUDA managed memory, which the driver
moves to host memory under pressure instead of failing with out-of-memory)."""
Sharding = Literal["full", "grad-op", "none"]
"""FSDP FULL_SHARD (parameters, gradients and optimizer states / N), SHARD_GRAD_OP
(gradients and optimizer states / N), or none (one GPU)."""
Objective = Literal["sft", "dpo"]
"""`sft`: next-token cross-entropy on the responses; `dpo`: Direct Preference Optimization on
{prompt, chosen, rejected} pairs (docs/dpo.md)."""
EarlyStoppingMetric = Literal["eval_loss", "eval_reward_accuracy"]
"""What early stopping watches: the validation loss (lower is better), or, with objective
`dpo`, the share of validation pairs whose chosen response out-rewards the rejected one
(higher is better)."""
PackedAttention = Literal["auto", "mask", "varlen"]
"""How packed rows keep their examples apart in attention (`kubetune_trainer.attention`):
`mask`: a block-diagonal causal mask given to SDPA; `varlen`: the examples' boundaries as
cumulative lengths to PyTorch's variable-length flash attention (CUDA, bf16/fp16; elsewhere
the same attention one example at a time); `auto`: `varlen` where that kernel runs and the
model's attention allows it, else `mask`."""
DatasetFormat = Literal["alpaca", "sharegpt", "chat", "instruction-response", "text"]
SourceKind = Literal["path", "hub", "s3", "https"]

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
"""The data files the trainer reads in a dataset folder (and the stage-in fetches)."""

METHODS: tuple[Method, ...] = get_args(Method)
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
OPTIMIZERS: tuple[Optimizer, ...] = get_args(Optimizer)
SHARDINGS: tuple[Sharding, ...] = get_args(Sharding)
DATASET_FORMATS: tuple[DatasetFormat, ...] = get_args(DatasetFormat)
OBJECTIVES: tuple[Objective, ...] = get_args(Objective)
EARLY_STOPPING_METRICS: tuple[EarlyStoppingMetric, ...] = get_args(EarlyStoppingMetric)
HIGHER_IS_BETTER: frozenset[EarlyStoppingMetric] = frozenset({"eval_reward_accuracy"})
EARLY_STOPPED = "early_stopped"
"""The outcome of a run that early stopping ended before its last step (`TrainerResult`);
version 1 trainers began their termination message with it:
`early_stopped step=<N> best_step=<M> metric=<name> value=<float> patience=<P>`."""

# Checkpoints: the trainer writes `<checkpoint.dir>/step-<N>/` by renaming a finished
# `.tmp-step-<N>/`; the operator reports the newest by the same name.
CHECKPOINT_PREFIX = "step-"
CHECKPOINT_TMP_PREFIX = f".tmp-{CHECKPOINT_PREFIX}"
CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


def checkpoint_dir_name(step: int) -> str:
    """`step-<step>`: the folder of the checkpoint taken after optimizer step `step`."""
    return f"{CHECKPOINT_PREFIX}{step}"


# The chunked loss (`training.chunked_cross_entropy`) projects this many tokens at a time: a
# chunk's fp32 logits take at most 256 MiB whatever the vocabulary (523 tokens at Llama-3's
# 128,256), and never fewer than 64 tokens. The estimator counts the same chunk.
LOSS_CHUNK_FP32_BYTES = 256 * 1024**2
LOSS_CHUNK_MIN_TOKENS = 64


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the chunked cross-entropy for a vocabulary of `vocab_size`."""
    return max(LOSS_CHUNK_MIN_TOKENS, LOSS_CHUNK_FP32_BYTES // (4 * max(vocab_size, 1)))


# The dense bf16 tensor-core peak of each GPU, from NVIDIA's datasheets: the trainer's MFU
# divides by it, and the operator's known GPU products (`kubetune.api.gpus`) and its built-in
# pool catalog plan with it. No other table holds these figures.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989),
    ("H200", 989),
    ("H100 PCIe", 756),
    ("H100", 989),
    ("H800", 989),
    ("B200", 2250),
    ("A100", 312),
    ("A800", 312),
    ("L40S", 362),
    ("L40", 181),
    ("NVIDIA A40", 149.7),  # not "A40" alone: "NVIDIA RTX A4000" contains it
    ("L4", 121),
    # AWS g5. NVIDIA publishes no A10G datasheet, and published A10-vs-A10G comparisons give
    # 70 dense bf16 TFLOPS (125 is the A10's datasheet figure).
    ("A10G", 70),
    ("A10", 125),
    ("RTX 4090", 165),
    ("V100", 125),
    ("T4", 65),
)
"""(a part of the GPU's name, TFLOPS): the first part the name contains wins, so a part that
contains another comes before it ("H100 PCIe" before "H100", "A10G" before "A10")."""


def peak_bf16_tflops(gpu_name: str) -> float | None:
    """The dense bf16 peak of a GPU named as `torch.cuda.get_device_name()` names it, or as
    GPU feature discovery labels it (`nvidia.com/gpu.product`: hyphens for the spaces); None
    for a GPU the table does not know."""
    name = gpu_name.replace("-", " ")
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in name:
            return tflops
    return None


# Exit codes of the trainer process; the operator's podFailurePolicy keys on them.
EXIT_OK = 0
EXIT_CONFIG_ERROR = 2
"""Bad config or data: retrying cannot help."""
EXIT_PREEMPTED = 42
"""SIGTERM received, checkpoint written: relaunch and resume."""
EXIT_OOM = 43
"""Out of GPU memory: re-plan with a safer configuration, then resume."""
EXIT_STOPPED = 44
"""A stop was requested (budget/deadline/suspend) and a checkpoint was written."""
EXIT_CHECKPOINT_FAILED = 45
"""A checkpoint could not be written (no room on the volume, a write error) or none of the
checkpoints on the volume can be loaded: relaunching would fail the same way. The previous
checkpoint, if any, is intact."""
EXIT_SUPERSEDED = 46
"""A later attempt of this job writes the checkpoint folder (its `writer.json` says so): this
stale one stopped having changed nothing there; retrying it cannot help."""


# Where the trainer ran out of GPU memory: `phase=<key>` in its termination message, and the
# words for it in messages (trainer and operator).
OOM_PHASES: dict[str, str] = {
    "load": "loading the model",
    "resume": "loading the checkpoint",
    "train": "training",
    "eval": "evaluating",
    "save": "saving a checkpoint",
    "export": "exporting the model",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JobRef(_Strict):
    name: str
    namespace: str = "default"
    uid: str = ""


class ModelRef(_Strict):
    source: str = Field(description="Local directory, or a hub id when kind is 'hub'.")
    kind: SourceKind = "path"
    revision: str | None = None
    token_env: str | None = Field(default=None, description="Env var holding a hub token.")


class DatasetRef(_Strict):
    source: str
    kind: SourceKind = "path"
    revision: str | None = Field(
        default=None, description="Git revision of a hub dataset (the default branch if unset)."
    )
    format: DatasetFormat = "alpaca"
    validation_split: float = 0.0


class LoraConfig(_Strict):
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"])
    double_quant: bool = True


class DpoConfig(_Strict):
    """The DPO loss: sigmoid, `beta` the strength of the pull towards the reference model,
    `label_smoothing` the assumed rate of flipped preference labels (conservative DPO)."""

    beta: float = Field(default=0.1, gt=0)
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)


class EarlyStoppingConfig(_Strict):
    """Stop when `metric` has not improved by more than `min_delta` for `patience`
    evaluations in a row; the output is then the best evaluated step's weights."""

    patience: int = Field(default=3, ge=1)
    min_delta: float = Field(default=0.0, ge=0)
    metric: EarlyStoppingMetric = "eval_loss"


class TrainingConfig(_Strict):
    epochs: float = 1.0
    max_steps: int | None = None
    total_steps: int = Field(description="Optimizer steps the plan expects (for ETA).")
    learning_rate: float = 2e-4
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    sequence_length: int = 2048
    global_batch_size: int = 32
    micro_batch_size: int = 1
    gradient_accumulation: int = 1
    packing: bool = True
    gradient_checkpointing: bool = True
    precision: Precision = "bf16"
    optimizer: Optimizer = "adamw"
    chunked_cross_entropy: bool = Field(
        default=False, description="The loss over chunks of tokens (kubetune_trainer.loss)."
    )
    fused_cross_entropy: bool = Field(
        default=False,
        description="The output projection and the loss in one kernel, Liger's fused linear "
        "cross-entropy, on CUDA (kubetune_trainer.loss); elsewhere the chunked loss.",
    )
    activation_offloading: bool = Field(
        default=False, description="Tensors saved for backward kept in host memory."
    )
    optimizer_in_backward: bool = Field(
        default=False,
        description="Step each parameter as soon as backward makes its gradient, then free it "
        "(kubetune_trainer.backward_step): no gradient clipping, accumulation 1, no DDP.",
    )
    packed_attention: PackedAttention = Field(
        default="auto",
        description="How packed rows keep their examples apart in attention (no effect "
        "without packing): `mask`, `varlen` or `auto` (kubetune_trainer.attention).",
    )
    seed: int = 42
    objective: Objective = Field(
        default="sft",
        description="`sft` (cross-entropy on responses) or `dpo` (preference pairs); with `dpo` "
        "the dataset holds {prompt, chosen, rejected} records and packing does not apply.",
    )
    dpo: DpoConfig = Field(default_factory=DpoConfig)
    early_stopping: EarlyStoppingConfig | None = Field(
        default=None,
        description="Stop when the validation metric stops improving (None: train to the end).",
    )


class ParallelConfig(_Strict):
    nodes: int = 1
    gpus_per_node: int = 1
    sharding: Sharding = "full"
    cpu_offload: bool = False


class CheckpointConfig(_Strict):
    dir: str = "/checkpoints"
    interval_steps: int | None = None
    interval_minutes: float = 30.0
    keep: int = 2
    resume_from_uid: str | None = Field(
        default=None,
        description="UID of another (earlier) job whose checkpoints in `dir` this job resumes; "
        "unset: checkpoints another job wrote are moved aside and the run starts at step 0.",
    )
    attempt: int | None = Field(
        default=None,
        description="The operator's attempt number: the writer epoch of `dir` "
        "(kubetune_trainer.fence). Unset: a run outside the operator, not fenced.",
    )


class OutputConfig(_Strict):
    dir: str = "/checkpoints/output"
    merge_adapter: bool = False


class MetricsConfig(_Strict):
    port: int = 9400
    log_path: str | None = Field(default=None, description="JSON-lines metrics log.")


InjectableOomPhase = Literal["load", "eval", "save", "export"]
"""The phases (keys of OOM_PHASES) where `FaultInjection.oom_in_phase` can run out of memory."""


class FaultInjection(_Strict):
    """Test-only switches to force failure paths; never set by the planner."""

    oom_at_step: int | None = None
    hang_at_step: int | None = Field(
        default=None,
        ge=1,
        description="Before this step the trainer stops making progress for good and ignores "
        "stop requests, as a rank stuck in a collective does: the operator's stall detection "
        "must notice.",
    )
    oom_in_phase: InjectableOomPhase | None = Field(
        default=None,
        description="The first time the trainer enters this phase it runs out of GPU memory "
        "(a simulated torch.OutOfMemoryError), as a model too large to load, an evaluation "
        "batch, a checkpoint gather or a merge for export would.",
    )
    kill_at_step: int | None = Field(
        default=None,
        ge=1,
        description="Before this step one rank (kill_rank) SIGKILLs itself, as the kernel or "
        "a crashing CUDA driver would: no checkpoint, no message. Once per job (a marker under "
        "the checkpoint folder's .faults/), so the pod that replaces it trains on.",
    )
    kill_rank: int = Field(default=0, ge=0, description="The rank kill_at_step kills.")
    host_memory_at_step: int | None = Field(
        default=None,
        ge=1,
        description="Before this step rank 0 allocates host memory until the kernel kills the "
        "container for its memory limit (OOMKilled), as a dataset or an offload buffer too "
        "large for the pod would. Once per job (a marker under .faults/); without a memory "
        "limit (no cgroup limit to reach) it does nothing but say so.",
    )
    disk_full_at_step: int | None = Field(
        default=None,
        ge=1,
        description="The checkpoint of this step finds no free space on the volume (the "
        "free-space check reads 0 bytes free), as a full volume would.",
    )
    min_step_seconds: float | None = Field(
        default=None,
        gt=0,
        le=60,
        description="Each optimizer step takes at least this long (the trainer waits): keeps "
        "tiny test runs slow enough to interrupt at a chosen step.",
    )


class TrainerConfig(_Strict):
    contract_version: int = CONTRACT_VERSION
    job: JobRef
    method: Method
    model: ModelRef
    dataset: DatasetRef
    lora: LoraConfig | None = None
    training: TrainingConfig
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    faults: FaultInjection = Field(default_factory=FaultInjection)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


TrainerOutcome = Literal["completed", "early_stopped", "out_of_memory"]
"""How a trainer run ended, in its result: it trained to its last step, or early stopping
ended it sooner (both exit 0), or it ran out of GPU memory (exit 43)."""


class EarlyStoppingResult(_Strict):
    """How early stopping ended a run that had it on."""

    stopped_early: bool = Field(description="Patience ran out before the last step.")
    best_step: int = Field(description="The best evaluation's step: the output's weights.")
    metric: EarlyStoppingMetric
    best_value: float | None = Field(description="The metric at best_step.")
    patience: int | None = None
    evaluations_without_improvement: int | None = None


class OutOfMemoryResult(_Strict):
    """Where a rank ran out of GPU memory, and the most memory the run had taken."""

    peak_gib: float = Field(
        description="The most GPU memory the run had reserved, GiB (on CPU: peak RSS)."
    )
    step: int = Field(description="The step it ran out at (while training: the one in flight).")
    rank: int
    phase: str | None = Field(description="What it was doing: a key of OOM_PHASES.")
    message: str = Field(description="The error, in words, on one line.")


class TrainerResult(_Strict):
    """What a trainer run ended with, as one line of JSON in its termination message: rank
    0's on exit 0, each rank's that ran out of memory on exit 43 (docs/trainer.md). The
    operator takes a finished job's final numbers from it, and an out-of-memory re-plan's
    peak and phase. The other exits leave their reason and fix in words instead."""

    contract_version: int = CONTRACT_VERSION
    outcome: TrainerOutcome
    step: int = Field(description="Optimizer steps finished.")
    total_steps: int | None = Field(
        default=None, description="Optimizer steps planned (unknown before the data is read)."
    )
    loss: float | None = Field(
        default=None,
        description="The training loss of the last finished step, as the trainer "
        "computed it (None before the first).",
    )
    eval_loss: float | None = Field(default=None, description="The last evaluation's loss.")
    tokens_seen: int | None = Field(default=None, description="Tokens trained on, all ranks.")
    early_stopping: EarlyStoppingResult | None = Field(
        default=None, description="With early stopping on: how it ended."
    )
    out_of_memory: OutOfMemoryResult | None = Field(
        default=None, description="Outcome out_of_memory: where and how much."
    )


class StageInConfig(_Strict):
    """What the stage-in step fetches, checks and measures before any GPU is asked for.

    The operator runs it as a CPU-only pod (`python -m kubetune_trainer.stagein --config F`)
    with the shared cache volume mounted at `cache_dir`. It fetches the model and the dataset
    into the cache (once per source and revision, whichever job asks first), checks them
    (config.json, tokenizer, records) and measures the dataset with the model's tokenizer;
    it writes a `StageInResult` as JSON to `result_path` and, compact, to the termination
    message. Exit 0: staged; EXIT_CONFIG_ERROR: a permanent failure (no access, no such
    object, bad data, a different architecture than planned) named in the termination
    message; anything else: transient (the batch Job retries it).

    Credentials come from the environment, as the clients read them: `HF_TOKEN` (the env var
    `model.token_env` names) for the hub; `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
    `AWS_REGION` and `AWS_ENDPOINT_URL` (an S3-compatible store) for S3.
    """

    contract_version: int = CONTRACT_VERSION
    job: JobRef
    model: ModelRef
    dataset: DatasetRef
    cache_dir: str = "/cache"
    result_path: str = Field(description="Where the StageInResult JSON is written.")
    method: Method
    sequence_length: int = 2048
    packing: bool = True
    objective: Objective = Field(
        default="sft",
        description="How the dataset is checked and measured: `sft` records (examples, tokens, "
        "packed rows) or `dpo` preference pairs (pairs, tokens of both sides, no packing).",
    )
    model_type: str | None = Field(
        default=None,
        description="The config.json `model_type` the plan assumed; a different one fails.",
    )
    metrics_port: int | None = Field(
        default=None,
        description="Serve the stage-in's progress (STAGE_IN_METRICS) on this port while it "
        "runs; None: no endpoint.",
    )
    cache_max_bytes: int | None = Field(
        default=None,
        ge=0,
        description="After staging, evict least-recently-used cache entries until the cache "
        "holds at most this many bytes; None: never evict.",
    )
    keep_paths: list[str] = Field(
        default_factory=list,
        description="Cache entries (model_path/dataset_path of unfinished jobs, inside "
        "cache_dir) that eviction never removes: other jobs read them now.",
    )


class StageInResult(_Strict):
    """What the stage-in step found: where the files are and what the data measures."""

    model_path: str = Field(description="The model directory, inside cache_dir.")
    dataset_path: str = Field(description="The dataset file or directory, inside cache_dir.")
    model_config_json: dict[str, object] = Field(
        default_factory=dict, description="The model's config.json, as fetched."
    )
    examples: int = Field(description="Records (DPO: pairs) in the training split.")
    tokens: int = Field(description="Tokens in one epoch of the training split, templated.")
    packed_sequences: int = Field(
        description="Sequences of sequence_length one epoch packs into (records, unpacked; "
        "DPO: pairs)."
    )
    downloaded_bytes: int = 0
    reused_bytes: int = Field(default=0, description="Bytes found in the cache already.")
    seconds: float = 0.0


STAGE_IN_METRICS = {
    "bytes_done": "kubetune_trainer_stagein_bytes_done",
    "bytes_total": "kubetune_trainer_stagein_bytes_total",
    "files_done": "kubetune_trainer_stagein_files_done",
    "files_total": "kubetune_trainer_stagein_files_total",
}
"""The stage-in's progress gauges (bytes and files fetched of those to fetch; a total is 0
until known), served on `StageInConfig.metrics_port` and read by the operator."""


class StageOutConfig(_Strict):
    """What the stage-out step uploads once training succeeded.

    The operator runs it as a CPU-only pod (`python -m kubetune_trainer.stageout --config F`)
    with the volume that holds the run's output mounted read-only. It uploads every file
    under `source_dir` to `destination` (`s3://bucket/prefix`), large files in parts of
    `part_bytes`, then `UPLOAD_MANIFEST` (files, sizes, sha256) last: a store that has the
    manifest has the whole output. An object already there with the same size and sha256 is
    not sent again, so a retried upload sends only what is missing. Exit 0: uploaded (the
    termination message is the `StageOutResult` as JSON); EXIT_CONFIG_ERROR: permanent (no
    access, no such bucket, nothing to upload); anything else: transient (retried).

    Credentials come from the environment as boto3 reads them (`AWS_ACCESS_KEY_ID`,
    `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`).
    """

    contract_version: int = CONTRACT_VERSION
    job: JobRef
    source_dir: str = Field(description="The output directory to upload (read-only).")
    destination: str = Field(description="`s3://bucket/prefix` the files go under.")
    part_bytes: int = Field(
        default=64 * 1024**2,
        ge=5 * 1024**2,
        description="Files larger than this go up in parts of this size (S3's minimum is 5 MiB).",
    )


class StageOutResult(_Strict):
    """What the stage-out step uploaded."""

    destination: str
    files: int = Field(description="Files under source_dir, the manifest not counted.")
    bytes: int = Field(description="Their total size.")
    uploaded_bytes: int = Field(description="Bytes sent this time.")
    skipped_bytes: int = Field(default=0, description="Bytes already in the store, not resent.")
    seconds: float = 0.0


UPLOAD_MANIFEST = "kubetune-upload.json"
"""Written last under the destination: {"files": [{"path", "bytes", "sha256"}], "job": ...}."""


# GGUF export: the types llama.cpp's converter writes itself, then those that need its
# quantizer (llama-quantize's names, lower case). The API's spec.output.gguf.quantization and
# kubetune_trainer.gguf take them from here.
GGUFConverterType = Literal["f32", "f16", "bf16", "q8_0"]
GGUFQuantizerType = Literal[
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q2_k",
    "q3_k_s",
    "q3_k_m",
    "q3_k_l",
    "q4_k_s",
    "q4_k_m",
    "q5_k_s",
    "q5_k_m",
    "q6_k",
]
GGUFType = Literal[GGUFConverterType, GGUFQuantizerType]
GGUF_CONVERTER_TYPES: tuple[GGUFConverterType, ...] = get_args(GGUFConverterType)
GGUF_QUANTIZER_TYPES: tuple[GGUFQuantizerType, ...] = get_args(GGUFQuantizerType)
GGUF_TYPES: tuple[str, ...] = GGUF_CONVERTER_TYPES + GGUF_QUANTIZER_TYPES


class ExportConfig(_Strict):
    """What the export step turns into GGUF once training succeeded.

    The operator runs it as a CPU-only pod (`python -m kubetune_trainer.export --config F`)
    with the volume that holds the run's output mounted read-write. It converts the whole
    model in `model_dir` (a merged LoRA model or a full fine-tune's model) into `out_file`
    with llama.cpp's converter (and quantizer for k-quants), writing under a temporary name
    and renaming when complete. Exit 0: written (the termination message is the
    `ExportResult` as JSON); EXIT_CONFIG_ERROR: permanent (no model there, an architecture or
    type llama.cpp cannot write, no quantizer in the image); anything else: transient
    (retried)."""

    contract_version: int = CONTRACT_VERSION
    job: JobRef
    model_dir: str = Field(description="The whole model to convert (config.json, safetensors).")
    out_file: str = Field(description="The GGUF file to write.")
    quantization: GGUFType = "q8_0"
    pre_tokenizer: str | None = Field(
        default=None,
        description="llama.cpp's name for a BPE pre-tokenizer its converter does not "
        "recognise (e.g. gpt-2); models it knows ignore it.",
    )


class ExportResult(_Strict):
    """What the export step wrote."""

    file: str
    quantization: str
    bytes: int
    seconds: float = 0.0
    tool: str = Field(default="", description="convert_hf_to_gguf[+llama-quantize|llama_cpp].")


class ContractError(ValueError):
    pass


def _known_version(text: str, source: str) -> object:
    """The parsed JSON of a config, refusing contract versions this image does not know."""
    raw = json.loads(text)
    version = raw.get("contract_version") if isinstance(raw, dict) else None
    if version != CONTRACT_VERSION:
        raise ContractError(
            f"{source}: contract_version {version!r}, this trainer understands "
            f"{CONTRACT_VERSION}; to fix: use a trainer image that matches the operator"
        )
    return raw


def parse_config(text: str, source: str) -> TrainerConfig:
    """Validate a config's JSON text (read from `source`), refusing unknown contract versions."""
    return TrainerConfig.model_validate(_known_version(text, source))


def parse_stage_in_config(text: str, source: str) -> StageInConfig:
    """`parse_config` for the stage-in step's config."""
    return StageInConfig.model_validate(_known_version(text, source))


def parse_stage_out_config(text: str, source: str) -> StageOutConfig:
    """`parse_config` for the stage-out step's config."""
    return StageOutConfig.model_validate(_known_version(text, source))


def parse_export_config(text: str, source: str) -> ExportConfig:
    """`parse_config` for the export step's config."""
    return ExportConfig.model_validate(_known_version(text, source))
