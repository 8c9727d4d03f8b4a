"""The kubetune API: `FineTuneJob` and `GPUPool`, spec and status, as pydantic models.

These models are the single source of truth for the CRDs: `kubetune.api.crdgen` renders
`crds/*.yaml` from them (descriptions, defaults, enums, CEL rules), and the handlers
validate every object they read through them. Field names are camelCase on the wire
(aliases) and snake_case in Python.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kubetune.api.gpus import KNOWN_GPUS
from kubetune.api.vocabulary import GPU_PRODUCT_LABEL, Phase, PlanReason, QueueWait, RecoveryReason
from kubetune_trainer.contract import (
    DatasetFormat,
    GGUFType,
    Method,
    Optimizer,
    Precision,
    Sharding,
)
from kubetune_trainer.contract import EarlyStoppingMetric as StoppingMetric
from kubetune_trainer.contract import Objective as TrainingObjective
from kubetune_trainer.uris import (
    DATASET_FORMS,
    MODEL_FORMS,
    NOT_SPACE,
    OUTPUT_FORMS,
    Form,
    parse_uri,
    uri_pattern,
)

GROUP = "kubetune.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

MethodChoice = Literal["auto", Method]
Objective = Literal["cost", "time"]
SpotPolicy = Literal["never", "allowed", "preferred"]
AccessMode = Literal["auto", "ReadWriteOnce", "ReadWriteMany"]
RetentionPolicy = Literal["retain", "delete"]

DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(h|m|s))+$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
# The URI fields' patterns, composed of the forms `kubetune_trainer.uris` defines and parses,
# so that the apiserver (Go RE2), pydantic and the operator and trainer agree.
URI_PATTERN = uri_pattern(OUTPUT_FORMS)
DATASET_URI_PATTERN = uri_pattern(DATASET_FORMS)
MODEL_URI_PATTERN = uri_pattern(MODEL_FORMS)
DPO_NEEDS_OBJECTIVE = (
    "spec.training.dpo is only valid with spec.training.objective: dpo. To fix: set the "
    "objective to dpo, or remove spec.training.dpo"
)
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
INT64_MAX = 2**63 - 1


def parse_duration(text: str) -> timedelta:
    """Parse a Go-style duration such as ``90m``, ``1h30m`` or ``2.5h``."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{text!r} is not a duration; use forms like '90m', '12h' or '1h30m'")
    seconds = 0.0
    for number, _, unit in re.findall(r"([0-9]+(\.[0-9]+)?)(h|m|s)", text):
        seconds += float(number) * {"h": 3600, "m": 60, "s": 1}[unit]
    return timedelta(seconds=seconds)


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase JSON form, without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _checked_uri(value: Any, forms: tuple[Form, ...], field: str) -> Any:
    """A URI field's text, or the parser's error (what is wrong, "To fix:") before pydantic's
    pattern check says only that it does not match; both accept the same texts."""
    if isinstance(value, str):
        parse_uri(value, forms, field=field)
    return value


MESSAGE_LIMIT = 1024
"""Characters of a message in status: a spec's own strings, quoted into one, never grow a
status past what etcd stores (the CRD says so too, as maxLength)."""
_KEEP_TAIL = 300  # a message ends with its "To fix:"; the cut goes in the middle


def bounded(value: Any) -> Any:
    """A message of at most MESSAGE_LIMIT characters: a longer one keeps its start and its
    end (where the "To fix:" is) around an ellipsis."""
    if isinstance(value, str) and len(value) > MESSAGE_LIMIT:
        head = MESSAGE_LIMIT - _KEEP_TAIL - 3
        return f"{value[:head]} … {value[-_KEEP_TAIL:]}"
    return value


Message = Annotated[str, BeforeValidator(bounded), Field(max_length=MESSAGE_LIMIT)]
"""A status message: cut to MESSAGE_LIMIT characters when set."""


def _cel(rule: str, message: str) -> dict[str, Any]:
    return {"rule": rule, "message": message}


def _validations(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


# --------------------------------------------------------------------------- FineTuneJob


class SecretKeyRef(_Model):
    name: str = Field(
        description="Name of a Secret in the job's namespace.",
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
    )
    key: str = Field(
        default="token",
        description="Key inside the Secret that holds the value.",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
    )


class ModelSource(_Model):
    uri: str = Field(
        description=(
            "Base model to fine-tune: a Hugging Face id (`meta-llama/Llama-3.1-8B`, same as "
            "`hf://meta-llama/Llama-3.1-8B`), `pvc://<claim>/<path>` for a model directory on "
            "a PersistentVolumeClaim, `s3://bucket/prefix` (fetched into the namespace's "
            "model cache by the stage-in step; spec.s3 says how to reach the store), or "
            "`ftj://<name>`: the whole model another FineTuneJob of this namespace produces "
            "(full fine-tuning, or LoRA with output.mergeAdapter); this job waits until that "
            "one Succeeded. `gs://` is not supported: use `s3://` with GCS's S3-compatible "
            "endpoint, or `pvc://`."
        ),
        pattern=MODEL_URI_PATTERN,
        max_length=512,
    )
    revision: str | None = Field(
        default=None, description="Git revision (branch, tag or commit) of a hub model."
    )
    token_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret holding a hub access token for gated models."
    )
    architecture: str | None = Field(
        default=None,
        description=(
            "Architecture used for planning when the model's config.json cannot be read at plan "
            "time (e.g. `pvc://` models): a known model id such as `Qwen/Qwen2.5-7B`. "
            "See `kubetune estimate --list-models`."
        ),
    )

    @field_validator("uri", mode="before")
    @classmethod
    def _model_uri(cls, value: Any) -> Any:
        return _checked_uri(value, MODEL_FORMS, "spec.model.uri")


class DatasetSource(_Model):
    uri: str = Field(
        description=(
            "Training data: a JSONL/JSON/Parquet file or directory as `pvc://<claim>/<path>`, "
            "`s3://bucket/key-or-prefix` or `https://host/path/file.jsonl` (fetched, checked "
            "and measured by the stage-in step), a local path inside the trainer image, or a "
            "`datasets` hub id (fetched by the stage-in step too). `gs://` is not supported: "
            "use `s3://` with GCS's S3-compatible endpoint, or `pvc://`."
        ),
        pattern=DATASET_URI_PATTERN,
        max_length=512,
    )
    revision: str | None = Field(
        default=None,
        max_length=256,
        description="Git revision (branch, tag or commit) of a hub dataset; unset: its default "
        "branch. Pin a commit for a run that can be repeated.",
    )
    format: DatasetFormat = Field(
        default="alpaca",
        description=(
            "Record format: `alpaca` (instruction/input/output), `sharegpt` or `chat` "
            "(conversations rendered with the tokenizer's chat template), `instruction-response` "
            "(prompt/response fields), or `text` (plain text, loss on every token)."
        ),
    )
    validation_split: float = Field(
        default=0.0,
        ge=0.0,
        le=0.5,
        description="Fraction of records held out for evaluation loss (0 disables evaluation).",
    )
    num_examples: int | None = Field(
        default=None,
        ge=1,
        description="Number of training records; the planner uses it to estimate duration.",
    )
    avg_tokens_per_example: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Mean tokens per record after templating; with packing off the planner assumes "
            "every record is padded to `training.sequenceLength`."
        ),
    )
    total_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Tokens in one epoch of the training split. Overrides numExamples × "
            "avgTokensPerExample for planning."
        ),
    )

    @field_validator("uri", mode="before")
    @classmethod
    def _dataset_uri(cls, value: Any) -> Any:
        return _checked_uri(value, DATASET_FORMS, "spec.dataset.uri")


class LoraSettings(_Model):
    rank: int = Field(default=16, ge=1, le=1024, description="LoRA rank r.")
    alpha: int = Field(default=32, ge=1, description="LoRA scaling alpha (scale = alpha / rank).")
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=lambda: ["all-linear"],
        min_length=1,
        max_length=256,
        description=(
            "Module names that get adapters (e.g. `q_proj`, `v_proj`) or `all-linear` for every "
            "linear layer of the decoder blocks (MoE: Mixtral's and Qwen3-MoE's experts and "
            "router too, Qwen2-MoE's shared expert but not its routed experts; under QLoRA MoE "
            "experts stay bf16)."
        ),
    )
    double_quant: bool = Field(
        default=True, description="QLoRA only: quantize the NF4 quantization constants too."
    )


ONE_LOSS = (
    "spec.training.chunkedCrossEntropy and spec.training.fusedCrossEntropy are two ways to "
    "compute the same loss; to fix: set at most one of them to true"
)
OFFLOADING_NEEDS_CHECKPOINTING = (
    "spec.training.activationOffloading needs gradient checkpointing; to fix: leave "
    "spec.training.gradientCheckpointing unset or true, or turn offloading off"
)


class DPOSettings(_Model):
    beta: float = Field(
        default=0.1, gt=0, le=10, description="How strongly the policy is held near the reference."
    )
    # At most 0.49, not "under 0.5": the API server compares an integer-valued default (0)
    # with an exclusive float maximum as integers, and would refuse the CRD.
    label_smoothing: float = Field(
        default=0.0, ge=0, le=0.49, description="Assumed share of flipped preference labels."
    )


EARLY_STOPPING_NEEDS_VALIDATION = (
    "spec.training.earlyStopping watches the validation metrics, and spec.dataset."
    "validationSplit is 0 (no validation data). To fix: set spec.dataset.validationSplit, "
    "e.g. 0.05, or remove spec.training.earlyStopping"
)
REWARD_ACCURACY_NEEDS_DPO = (
    "spec.training.earlyStopping.metric eval_reward_accuracy is only valid with "
    "spec.training.objective: dpo. To fix: use metric eval_loss, or objective dpo"
)
EARLY_STOPPING_DEFAULTS: dict[str, Any] = {"patience": 3, "min_delta": 0.0, "metric": "eval_loss"}
"""What an unset field of spec.training.earlyStopping means (applied by the operator, not
the schema, so a change of default never rewrites stored jobs)."""


class EarlyStoppingSettings(_Model):
    """Stop training when the validation metric stops improving; the output is then the
    best evaluation's weights (docs/training.md#early-stopping). Unset fields take the
    defaults their descriptions name."""

    patience: int | None = Field(
        default=None,
        ge=1,
        le=1000,
        description="Evaluations in a row without improvement before training stops (unset: "
        "3). The trainer evaluates at every checkpoint (spec.checkpoint.intervalSteps or "
        "intervalMinutes), and patience counts evaluations, as HF's early_stopping_patience.",
    )
    min_delta: float | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="Smallest change of the metric that counts as an improvement (unset: 0; "
        "HF's early_stopping_threshold).",
    )
    metric: StoppingMetric | None = Field(
        default=None,
        description="`eval_loss` (validation loss, lower is better; unset means this) or, with "
        "objective dpo, `eval_reward_accuracy` (share of validation pairs whose chosen "
        "response gets the higher reward; higher is better).",
    )

    def effective(self) -> dict[str, Any]:
        """patience, min_delta and metric with the defaults filled in."""
        given = {k: getattr(self, k) for k in EARLY_STOPPING_DEFAULTS}
        return {k: EARLY_STOPPING_DEFAULTS[k] if v is None else v for k, v in given.items()}


class TrainingSettings(_Model):
    objective: TrainingObjective = Field(
        default="sft",
        description=(
            "`sft`: cross-entropy on the responses; `dpo`: Direct Preference Optimization on "
            "{prompt, chosen, rejected} records (docs/dpo.md): batch sizes count pairs, "
            "packing does not apply."
        ),
    )
    dpo: DPOSettings | None = Field(
        default=None, description="DPO's beta and label smoothing; only with objective dpo."
    )
    early_stopping: EarlyStoppingSettings | None = Field(
        default=None,
        description="Stop when the validation metric stops improving (needs "
        "spec.dataset.validationSplit); unset: train all epochs or maxSteps.",
    )
    epochs: float = Field(default=1.0, gt=0, le=100, description="Passes over the training data.")
    max_steps: int | None = Field(
        default=None,
        ge=1,
        le=100_000_000,
        description="Stop after this many optimizer steps (overrides epochs).",
    )
    learning_rate: float = Field(default=2e-4, gt=0, lt=1, description="Peak learning rate.")
    warmup_ratio: float = Field(
        default=0.03, ge=0, lt=1, description="Fraction of steps with linear warmup."
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    sequence_length: int = Field(
        default=2048, ge=16, le=1_048_576, description="Tokens per training sequence."
    )
    global_batch_size: int = Field(
        default=32,
        ge=1,
        description=(
            "Sequences per optimizer step across all GPUs; the planner splits it into "
            "micro-batch × gradient accumulation × data-parallel GPUs."
        ),
    )
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Sequences per GPU per forward pass; unset lets the planner choose.",
    )
    packing: bool = Field(default=True, description="Pack several records into each sequence.")
    gradient_checkpointing: bool | None = Field(
        default=None,
        description="Recompute activations in backward; unset lets the planner choose.",
    )
    precision: Precision = Field(
        default="bf16",
        description=(
            "`bf16`: bf16 weights, gradients and optimizer states; `amp-bf16`: fp32 master "
            "weights with bf16 compute (twice the memory for full fine-tuning); `fp32`: "
            "everything in fp32."
        ),
    )
    optimizer: Optimizer = Field(
        default="adamw",
        description=(
            "`adamw` (torch), or bitsandbytes' `adamw-8bit`, `paged-adamw-8bit` or "
            "`paged-adamw-32bit` (paged states move to host memory under GPU memory pressure)."
        ),
    )
    chunked_cross_entropy: bool | None = Field(
        default=None,
        description=(
            "Compute the loss a few hundred tokens at a time instead of over full-vocabulary "
            "fp32 logits (same loss and gradients, no extra compute); unset lets the planner "
            "turn it on when a configuration fits only with it."
        ),
    )
    fused_cross_entropy: bool | None = Field(
        default=None,
        description=(
            "Compute the output projection and the loss in one kernel (Liger's fused linear "
            "cross-entropy, on CUDA): nothing of vocabulary size is kept for backward, less "
            "memory than the chunked loss, same loss and gradients. Not for models that "
            "soft-cap their logits (Gemma 2) or with a LoRA adapter on lm_head. Unset lets "
            "the planner turn it on when a configuration fits only with it; at most one of "
            "this and chunkedCrossEntropy may be true."
        ),
    )
    activation_offloading: bool | None = Field(
        default=None,
        description=(
            "Keep the activations saved for backward in host memory (with gradient "
            "checkpointing: one input per layer) at the cost of PCIe copies on every step; "
            "unset lets the planner turn it on when no configuration fits without it."
        ),
    )
    optimizer_in_backward: bool | None = Field(
        default=None,
        description=(
            "Full fine-tuning: step each parameter as soon as backward makes its gradient and "
            "free it, so a whole model's gradients never exist at once; gives up gradient-norm "
            "clipping, and applies only with one micro-batch per optimizer step and a sharded "
            "(or one-GPU) layout. true: wherever it applies; unset lets the planner turn it "
            "on when a configuration fits only with it."
        ),
    )
    seed: int = Field(default=42, ge=0, description="Random seed for data order and init.")

    @model_validator(mode="after")
    def _one_loss(self) -> TrainingSettings:
        if self.chunked_cross_entropy and self.fused_cross_entropy:
            raise ValueError(ONE_LOSS)
        return self

    @model_validator(mode="after")
    def _offloading_needs_checkpointing(self) -> TrainingSettings:
        if self.activation_offloading and self.gradient_checkpointing is False:
            raise ValueError(OFFLOADING_NEEDS_CHECKPOINTING)
        return self

    @model_validator(mode="after")
    def _dpo_settings_need_dpo(self) -> TrainingSettings:
        if self.dpo is not None and self.objective != "dpo":
            raise ValueError(DPO_NEEDS_OBJECTIVE)
        return self

    @model_validator(mode="after")
    def _reward_accuracy_needs_dpo(self) -> TrainingSettings:
        es = self.early_stopping
        if es is not None and es.metric == "eval_reward_accuracy" and self.objective != "dpo":
            raise ValueError(REWARD_ACCURACY_NEEDS_DPO)
        return self


class ResourceSettings(_Model):
    gpus: Annotated[int, Field(ge=1, le=4096)] | Literal["auto"] = Field(
        default="auto",
        description="Total GPUs, or `auto` to let the planner pick the count.",
        json_schema_extra={
            "x-kubernetes-int-or-string": True,
            **_validations(
                _cel(
                    "type(self) == int ? self >= 1 && self <= 4096 : self == 'auto'",
                    "spec.resources.gpus must be a positive integer or 'auto' (at most 4096)",
                )
            ),
        },
    )
    pools: list[str] = Field(
        default_factory=list,
        description="GPUPool names the job may use; empty means every pool.",
    )
    objective: Objective | None = Field(
        default=None,
        description=(
            "What the planner minimizes among feasible plans: `cost` or `time`. Unset: the "
            "operator's default (KUBETUNE_DEFAULT_OBJECTIVE, `cost` unless changed)."
        ),
    )
    deadline: str | None = Field(
        default=None,
        pattern=DURATION_PATTERN,
        description="Longest acceptable training time, e.g. `12h` or `90m`.",
    )
    max_cost_usd: float | None = Field(
        default=None,
        gt=0,
        alias="maxCostUSD",
        description="Budget in US dollars; the job stops cleanly with a checkpoint when reached.",
    )
    spot: SpotPolicy = Field(
        default="allowed",
        description="Spot/preemptible pools: `never`, `allowed`, or `preferred` (ties go to spot).",
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description=(
            "Place in the queue for a pool's GPUs: a higher priority goes first; jobs of equal "
            "priority go in the order they were created. It never stops a running job."
        ),
    )


class CheckpointStorage(_Model):
    size: str | None = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description="Checkpoint volume size; unset sizes it from the model and method.",
    )
    storage_class_name: str | None = Field(
        default=None,
        description="StorageClass of the checkpoint volume (cluster default if unset).",
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
    )
    access_mode: AccessMode = Field(
        default="auto",
        description=(
            "`auto`: ReadWriteMany where the operator is told its checkpoint StorageClass "
            "offers it (operator.checkpointReadWriteMany), else ReadWriteOnce. A job whose "
            "volume is ReadWriteOnce is planned on one node only."
        ),
    )
    retention: RetentionPolicy = Field(
        default="retain",
        description="What happens to the checkpoint volume when the job is deleted.",
    )


class CheckpointSettings(_Model):
    interval_steps: int | None = Field(
        default=None, ge=1, description="Save every N optimizer steps."
    )
    interval_minutes: float = Field(
        default=30.0, gt=0, description="Save at least this often (wall clock)."
    )
    keep: int = Field(default=2, ge=1, le=100, description="Complete checkpoints to keep.")
    storage: CheckpointStorage = Field(
        default_factory=CheckpointStorage, description="Volume that holds checkpoints."
    )
    resume_from_uid: str | None = Field(
        default=None,
        alias="resumeFromUID",
        pattern=r"^[0-9a-fA-F-]{1,64}$",
        max_length=64,
        description=(
            "UID of an earlier FineTuneJob of the same name whose checkpoints, left on the "
            "retained checkpoint volume, this job resumes. Unset: checkpoints another job left "
            "there are moved aside (to `foreign/` on the volume) and training starts at step 0."
        ),
    )


GGUF_NEEDS_A_WHOLE_MODEL = (
    "spec.output.gguf needs a whole model, and a LoRA/QLoRA run writes only an adapter "
    "unless spec.output.mergeAdapter is true. To fix: set spec.output.mergeAdapter: true "
    "(a full fine-tune ignores it), or use method full, or remove spec.output.gguf"
)


class GGUFSettings(_Model):
    """A GGUF file (llama.cpp, Ollama, LM Studio) made from the trained model after training,
    by a CPU-only export step (docs/serving.md)."""

    quantization: GGUFType = Field(
        default="q8_0",
        description="The GGUF type, as llama.cpp names it: f32, f16, bf16 and q8_0 are written "
        "by llama.cpp's converter; the k-quants and q4_0..q5_1 by its quantizer (the default "
        "trainer image has it; docs/serving.md).",
    )
    pre_tokenizer: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=r"^[a-z0-9][a-z0-9._-]*$",
        description="llama.cpp's name of the BPE pre-tokenizer (e.g. gpt-2, llama-bpe) for a "
        "tokenizer its converter does not recognise; unset for models it knows.",
    )


class OutputSettings(_Model):
    uri: str | None = Field(
        default=None,
        pattern=URI_PATTERN,
        description=(
            "Where the adapter (and merged model) go: `pvc://<claim>/<path>`; "
            "`s3://bucket/prefix` (written to the checkpoint volume under `output/`, then "
            "uploaded by the stage-out step; the job succeeds once the upload completed; "
            "spec.s3 says how to reach the store); unset keeps them in the checkpoint volume "
            "under `output/`."
        ),
    )
    merge_adapter: bool = Field(
        default=False, description="Also write the base model with the adapter merged in."
    )
    gguf: GGUFSettings | None = Field(
        default=None,
        description="Also write the trained model as GGUF to `output/gguf/<job>-<quantization>"
        ".gguf` (before the upload of an `s3://` output). LoRA/QLoRA need mergeAdapter: true.",
    )

    @field_validator("uri", mode="before")
    @classmethod
    def _output_uri(cls, value: Any) -> Any:
        return _checked_uri(value, OUTPUT_FORMS, "spec.output.uri")


class RecoverySettings(_Model):
    max_oom_replans: int = Field(
        default=3,
        alias="maxOOMReplans",
        ge=0,
        le=20,
        description="Re-plans after running out of memory before failing: of GPU memory "
        "(a safer layout) and of host memory (the kernel killed a trainer, OOMKilled: 1.5× "
        "the host memory), counted together.",
    )
    max_restarts: int = Field(
        default=10,
        ge=0,
        le=1000,
        description="Relaunches after a failed trainer, a stall or a move to another pool.",
    )
    max_preemptions_without_progress: int = Field(
        default=10,
        ge=1,
        le=1000,
        description="Preemptions in a row with no new checkpoint between them before the job "
        "fails; a preemption after progress starts the count again.",
    )
    stall_timeout_seconds: int | None = Field(
        default=None,
        ge=0,
        le=604_800,
        description="Relaunch the attempt from its checkpoint when the step count has not "
        "moved this long (once the attempt trained past its checkpoint); 0: never; unset: "
        "the operator's KUBETUNE_TRAINING_STALL_SECONDS or 20 planned steps, whichever is "
        "longer.",
    )


class S3Settings(_Model):
    """How the stage-in step reaches the S3 store that `s3://` URIs name."""

    credentials_secret: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description=(
            "Secret in the job's namespace with keys AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (the namespace must allow it, like the hub token: "
            "docs/security.md). Unset: the pod's own identity (IRSA, an instance role)."
        ),
    )
    region: str | None = Field(
        default=None, pattern=r"^[a-z0-9-]{1,40}$", description="Region, e.g. `eu-west-1`."
    )
    endpoint: str | None = Field(
        default=None,
        pattern=rf"^https?://[^\t\n\f\r /]+(/{NOT_SPACE}*)?$",
        max_length=512,
        description="Endpoint of an S3-compatible store (MinIO, Ceph RGW, R2); unset: AWS.",
    )


class FineTuneJobSpec(_Model):
    """Desired state of one fine-tuning run."""

    model: ModelSource = Field(description="The base model.")
    dataset: DatasetSource = Field(description="The training data.")
    method: MethodChoice = Field(
        default="auto",
        description=(
            "`full`, `lora`, `qlora`, or `auto` (the cheapest method that fits, by the objective)."
        ),
    )
    lora: LoraSettings | None = Field(
        default=None, description="LoRA/QLoRA settings; only valid with a LoRA method."
    )
    training: TrainingSettings = Field(
        default_factory=TrainingSettings, description="Hyperparameters."
    )
    resources: ResourceSettings = Field(
        default_factory=ResourceSettings, description="GPUs, pools, objective, deadline, budget."
    )
    checkpoint: CheckpointSettings = Field(
        default_factory=CheckpointSettings, description="Checkpoint interval and storage."
    )
    output: OutputSettings = Field(
        default_factory=OutputSettings, description="Where the result goes."
    )
    s3: S3Settings | None = Field(
        default=None, description="Credentials, region and endpoint for `s3://` URIs."
    )
    recovery: RecoverySettings = Field(
        default_factory=RecoverySettings, description="Limits on automatic recovery."
    )
    trainer_image: str | None = Field(
        default=None,
        description="Trainer image override (the operator's default otherwise).",
        min_length=1,
        max_length=512,
        json_schema_extra=_validations(
            _cel("self == self.trim()", "spec.trainerImage must not start or end with whitespace")
        ),
    )
    suspend: bool = Field(
        default=False,
        description="Stop the run after a checkpoint and keep it resumable; set false to resume.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        le=315_360_000,  # ten years
        description="Delete the job this long after it succeeds or fails.",
    )

    @field_validator("trainer_image")
    @classmethod
    def _image_without_edge_whitespace(cls, value: str | None) -> str | None:
        if value is not None and value != value.strip():
            raise ValueError("spec.trainerImage must not start or end with whitespace")
        return value

    @field_validator("lora")
    @classmethod
    def _lora_only_with_lora_method(
        cls, value: LoraSettings | None, info: Any
    ) -> LoraSettings | None:
        method = info.data.get("method")
        if value is not None and method == "full":
            raise ValueError(
                "spec.lora is set but spec.method is 'full'; to fix: remove spec.lora "
                "or use method lora, qlora or auto"
            )
        return value

    @model_validator(mode="after")
    def _gguf_needs_a_whole_model(self) -> FineTuneJobSpec:
        out = self.output
        if out.gguf is not None and self.method != "full" and not out.merge_adapter:
            raise ValueError(GGUF_NEEDS_A_WHOLE_MODEL)
        return self

    @model_validator(mode="after")
    def _early_stopping_needs_validation(self) -> FineTuneJobSpec:
        if self.training.early_stopping is not None and self.dataset.validation_split <= 0:
            raise ValueError(EARLY_STOPPING_NEEDS_VALIDATION)
        return self

    @property
    def lora_or_default(self) -> LoraSettings:
        return self.lora if self.lora is not None else LoraSettings()


FINETUNEJOB_SPEC_RULES = [
    _cel(
        "!has(self.lora) || self.method != 'full'",
        "spec.lora is only valid with method lora, qlora or auto; "
        "to fix: remove spec.lora or change spec.method",
    ),
    _cel(
        "!has(self.resources) || !has(self.resources.deadline) || "
        "duration(self.resources.deadline) > duration('0s')",
        "spec.resources.deadline must be longer than zero, e.g. '12h'",
    ),
    _cel(
        "!has(self.training) || !has(self.training.microBatchSize) || "
        "self.training.globalBatchSize % self.training.microBatchSize == 0",
        "spec.training.globalBatchSize must be a multiple of spec.training.microBatchSize",
    ),
    _cel(
        "!has(self.training) || !has(self.training.earlyStopping) || "
        "(has(self.dataset.validationSplit) && self.dataset.validationSplit > 0.0)",
        EARLY_STOPPING_NEEDS_VALIDATION,
    ),
    _cel(
        "!has(self.training) || !has(self.training.earlyStopping) || "
        "!has(self.training.earlyStopping.metric) || "
        "self.training.earlyStopping.metric != 'eval_reward_accuracy' || "
        "(has(self.training.objective) && self.training.objective == 'dpo')",
        REWARD_ACCURACY_NEEDS_DPO,
    ),
    _cel(
        "!has(self.training) || !has(self.training.activationOffloading) || "
        "!self.training.activationOffloading || !has(self.training.gradientCheckpointing) || "
        "self.training.gradientCheckpointing",
        OFFLOADING_NEEDS_CHECKPOINTING,
    ),
    _cel(
        "!has(self.training) || !has(self.training.chunkedCrossEntropy) || "
        "!has(self.training.fusedCrossEntropy) || "
        "!(self.training.chunkedCrossEntropy && self.training.fusedCrossEntropy)",
        ONE_LOSS,
    ),
    _cel(
        "!has(self.training) || !has(self.training.dpo) || "
        "(has(self.training.objective) && self.training.objective == 'dpo')",
        DPO_NEEDS_OBJECTIVE,
    ),
    _cel(
        "!has(self.output) || !has(self.output.gguf) || self.method == 'full' || "
        "(has(self.output.mergeAdapter) && self.output.mergeAdapter)",
        GGUF_NEEDS_A_WHOLE_MODEL,
    ),
]

# Transition rules: once training has started (status.phase beyond Planning/Queued) the
# identity of the run must not change; they are attached to the root of the schema because
# CEL transition rules on spec cannot see status.
FINETUNEJOB_ROOT_RULES = [
    _cel(
        "!has(oldSelf.status) || !has(oldSelf.status.phase) || "
        "oldSelf.status.phase in ['Pending', 'Planning', 'Queued'] || "
        "(self.spec.model == oldSelf.spec.model && self.spec.dataset == oldSelf.spec.dataset "
        "&& self.spec.method == oldSelf.spec.method)",
        "spec.model, spec.dataset and spec.method cannot change once training has started; "
        "to fix: create a new FineTuneJob",
    ),
]


# --------------------------------------------------------------------------- status


class Condition(_Model):
    """A Kubernetes condition (metav1.Condition semantics)."""

    type: str = Field(description="Condition type, e.g. Planned, Running, Succeeded.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase machine-readable reason.")
    message: Message = Field(default="", description="Human-readable details.")
    last_transition_time: str = Field(description="When status last flipped (RFC 3339).")
    observed_generation: int | None = Field(
        default=None, description="spec generation the condition was computed from."
    )


class PlanAlternative(_Model):
    pool: str = Field(description="GPUPool name.")
    method: Method = Field(description="Fine-tuning method.")
    total_gpus: int = Field(alias="totalGPUs", description="GPUs in total.")
    nodes: int = Field(description="Nodes.")
    per_gpu_memory_gib: float = Field(
        alias="perGPUMemoryGiB", description="Estimated peak memory per GPU (GiB)."
    )
    estimated_duration_seconds: float = Field(description="Estimated training time.")
    estimated_cost_usd: float = Field(description="Estimated cost.", alias="estimatedCostUSD")


class PlanRejection(_Model):
    pool: str = Field(description="GPUPool name.")
    reason: Message = Field(description="Why no configuration on this pool was acceptable.")


class PlanStatus(_Model):
    revision: int = Field(default=1, description="1 for the first plan, +1 for each re-plan.")
    memory_scale: float = Field(
        default=1.0, description="Factor applied to memory estimates (raised after an OOM)."
    )
    host_memory_scale: float = Field(
        default=1.0,
        description="Factor applied to the trainer pods' host memory (×1.5 after each time "
        "the kernel killed a trainer for memory, OOMKilled).",
    )
    reason: PlanReason = Field(default=PlanReason.INITIAL, description="Why this plan was made.")
    message: Message | None = Field(
        default=None,
        description="What made the re-plan necessary, e.g. the layout that ran out of memory.",
    )
    method: Method = Field(description="Chosen fine-tuning method.")
    pool: str = Field(description="Chosen GPUPool.")
    gpu_product: str = Field(alias="gpuProduct", description="GPU model of the pool.")
    gpu_memory_gib: float = Field(
        alias="gpuMemoryGiB", description="Memory per GPU of the pool (GiB)."
    )
    nodes: int = Field(description="Nodes (one trainer pod each).")
    gpus_per_node: int = Field(alias="gpusPerNode", description="GPUs per pod.")
    total_gpus: int = Field(alias="totalGPUs", description="nodes × gpusPerNode.")
    spot: bool = Field(default=False, description="Whether the pool is spot/preemptible.")
    sharding: Sharding = Field(description="FSDP sharding strategy.")
    precision: Precision = Field(description="Numeric precision.")
    optimizer: Optimizer = Field(description="Optimizer.")
    micro_batch_size: int = Field(description="Sequences per GPU per forward pass.")
    gradient_accumulation: int = Field(description="Micro-batches per optimizer step.")
    gradient_checkpointing: bool = Field(description="Activation recomputation on/off.")
    chunked_cross_entropy: bool | None = Field(
        default=None, description="The loss computed over chunks of tokens (unset: off)."
    )
    fused_cross_entropy: bool | None = Field(
        default=None,
        description="The output projection and the loss in one kernel (unset: off).",
    )
    activation_offloading: bool | None = Field(
        default=None, description="Activations saved for backward kept in host memory (unset: off)."
    )
    optimizer_in_backward: bool | None = Field(
        default=None,
        description="Each parameter stepped during backward, its gradient freed (unset: off).",
    )
    per_gpu_memory_gib: float = Field(
        alias="perGPUMemoryGiB", description="Estimated peak memory per GPU (GiB)."
    )
    memory_breakdown_gib: dict[str, float] = Field(
        alias="memoryBreakdownGiB",
        default_factory=dict,
        description="Estimated peak memory per GPU by component (GiB).",
    )
    host_offload_gib: float | None = Field(
        default=None,
        alias="hostOffloadGiB",
        description="Host memory per trainer pod that the plan itself fills: the activations "
        "offloaded from its GPUs (GiB; unset: none).",
    )
    host_memory_gib: float | None = Field(
        default=None,
        alias="hostMemoryGiB",
        description="Host memory of each trainer pod, requested and (unless the operator "
        "runs with KUBETUNE_TRAINER_MEMORY_LIMIT=false) its limit: the operator's memory "
        "per GPU × gpusPerNode, plus hostOffloadGiB, times hostMemoryScale (GiB; unset in "
        "plans made before it existed).",
    )
    trainable_params: int = Field(description="Parameters updated by training.")
    model_params: int = Field(description="Parameters of the base model.")
    total_steps: int = Field(description="Optimizer steps planned.")
    total_tokens: int = Field(description="Tokens processed over all epochs.")
    estimated_tokens_per_second: float = Field(description="Cluster-wide throughput estimate.")
    estimated_duration_seconds: float = Field(description="Estimated training time.")
    estimated_cost_usd: float = Field(description="Estimated cost.", alias="estimatedCostUSD")
    price_per_hour_usd: float = Field(
        description="What the planned GPUs cost per hour.", alias="pricePerHourUSD"
    )
    alternatives: list[PlanAlternative] = Field(
        default_factory=list, description="Next-best feasible plans, best first."
    )
    rejected: list[PlanRejection] = Field(
        default_factory=list, description="Pools that could not run the job, with the reason."
    )

    @model_validator(mode="before")
    @classmethod
    def _reason_written_as_text(cls, data: Any) -> Any:
        """Statuses written before plan reasons were a closed set hold the reason and its
        details in one string ("OutOfMemory: lora 1×h100 ... ran out of memory")."""
        if not isinstance(data, dict):
            return data
        reason = data.get("reason")
        if isinstance(reason, str) and reason not in PlanReason.__members__.values():
            head, _, rest = reason.partition(":")
            if head in PlanReason.__members__.values():
                data = {**data, "reason": head}
                if rest.strip() and not data.get("message"):
                    data["message"] = rest.strip()
        return data


class QueueStatus(_Model):
    """Where a Queued job waits for GPUs (status.queue), as of its last look: each pool's
    queue goes by spec.resources.priority, then creation time. status.message says the same
    for people; this is what programs (and the operator's own write throttle) read."""

    pool: str = Field(description="The GPUPool whose queue the job is in.")
    position: int = Field(ge=1, description="Its place in that queue (1: it goes next).")
    jobs_ahead: int = Field(ge=0, description="Jobs of that queue that go first (position - 1).")
    waiting_for: QueueWait = Field(
        description="JobsAhead: jobs ahead of it go first; FreeGPUs: its pool lacks free GPUs "
        "for its plan."
    )


class ProgressStatus(_Model):
    step: int = Field(default=0, description="Optimizer steps done.")
    total_steps: int = Field(default=0, description="Optimizer steps planned.")
    epoch: float = Field(default=0.0, description="Epochs done (fractional).")
    percent: int = Field(default=0, ge=0, le=100, description="step / totalSteps in percent.")
    summary: str | None = Field(
        default=None, description="Progress for humans, e.g. 120/400 (30%)."
    )
    loss: float | None = Field(default=None, description="Latest training loss.")
    eval_loss: float | None = Field(default=None, description="Latest evaluation loss.")
    dpo_reward_accuracy: float | None = Field(
        default=None,
        description="DPO jobs: fraction of the last step's pairs whose chosen response has the "
        "larger implicit reward (0-1).",
    )
    dpo_reward_margin: float | None = Field(
        default=None,
        description="DPO jobs: mean chosen minus rejected implicit reward, last step.",
    )
    dpo_rewards_chosen: float | None = Field(
        default=None, description="DPO jobs: mean implicit reward of the chosen responses."
    )
    dpo_rewards_rejected: float | None = Field(
        default=None, description="DPO jobs: mean implicit reward of the rejected responses."
    )
    eval_dpo_reward_accuracy: float | None = Field(
        default=None, description="DPO jobs: reward accuracy on the validation pairs."
    )
    eval_dpo_reward_margin: float | None = Field(
        default=None, description="DPO jobs: reward margin on the validation pairs."
    )
    tokens_per_second: float | None = Field(default=None, description="Measured throughput.")
    eta_seconds: float | None = Field(default=None, description="Estimated seconds left.")
    eta: str | None = Field(default=None, description="ETA in human form, e.g. 1h20m.")
    updated_at: str | None = Field(default=None, description="When progress was last read.")
    step_changed_at: str | None = Field(
        default=None,
        description="When the step count last moved, once attempt stepChangedAttempt trained "
        "past the checkpoint it resumed from (the stall timer).",
    )
    step_changed_attempt: int | None = Field(
        default=None, description="The attempt stepChangedAt belongs to."
    )


class UpstreamStatus(_Model):
    """The FineTuneJob an `ftj://` model comes from, once it Succeeded (status.upstream)."""

    name: str = Field(description="The upstream FineTuneJob.")
    uid: str = Field(description="Its uid when its result was taken.")
    model_uri: str = Field(description="Where its whole model is: a `pvc://` or `s3://` URI.")
    architecture: str | None = Field(
        default=None, description="What planning reads: the upstream's model id or architecture."
    )


class StageOutStatus(_Model):
    """What the stage-out step uploaded (status.stageOut)."""

    destination: str = Field(description="The `s3://` URI the output went to.")
    files: int | None = Field(default=None, description="Files uploaded (manifest not counted).")
    bytes: int | None = Field(default=None, description="Their total size.")
    uploaded_bytes: int | None = Field(default=None, description="Bytes sent by the last run.")
    skipped_bytes: int | None = Field(
        default=None, description="Bytes already in the store (an earlier, partial upload)."
    )
    seconds: float | None = Field(default=None, description="How long the upload took.")


class ExportStatus(_Model):
    """What the export step wrote (status.export)."""

    uri: str = Field(
        description="Where the GGUF file is: `pvc://<claim>/<path>` (an `s3://` output also "
        "has it under `gguf/` once uploaded)."
    )
    quantization: str = Field(description="Its GGUF type.")
    bytes: int | None = Field(default=None, description="Its size.")
    seconds: float | None = Field(default=None, description="How long the export took.")


class StageInStatus(_Model):
    """What the stage-in step fetched and measured (status.stageIn)."""

    model_path: str | None = Field(default=None, description="The model folder the trainer reads.")
    dataset_path: str | None = Field(default=None, description="The data the trainer reads.")
    examples: int | None = Field(default=None, description="Records measured (training split).")
    tokens: int | None = Field(default=None, description="Tokens of one epoch, measured.")
    assumed_tokens: int | None = Field(
        default=None, description="Tokens of one epoch the plan assumed before measuring."
    )
    downloaded_bytes: int | None = Field(default=None, description="Bytes fetched.")
    reused_bytes: int | None = Field(default=None, description="Bytes found in the cache.")
    seconds: float | None = Field(default=None, description="How long the stage-in took.")
    bytes_done: int | None = Field(
        default=None, description="While it runs: bytes fetched or found in the cache so far."
    )
    bytes_total: int | None = Field(
        default=None, description="While it runs: bytes to fetch in all (0 until known)."
    )
    files_done: int | None = Field(default=None, description="While it runs: files done.")
    files_total: int | None = Field(default=None, description="While it runs: files in all.")
    model_config_json: dict[str, Any] | None = Field(
        default=None,
        description="The model's config.json as staged: what planning reads when "
        "spec.model.architecture is unset.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class CheckpointStatus(_Model):
    latest_step: int = Field(description="Step of the newest complete checkpoint.")
    time: str = Field(description="When it was written (RFC 3339).")
    path: str | None = Field(default=None, description="Folder inside the checkpoint volume.")


class EarlyStoppedStatus(_Model):
    """Training stopped before its last step because the validation metric stopped
    improving (status.earlyStopped); the output holds the weights of step bestStep."""

    step: int = Field(description="The step training stopped at.")
    best_step: int = Field(description="The step of the best evaluation: the output's weights.")
    metric: StoppingMetric = Field(description="The metric watched.")
    value: float | None = Field(default=None, description="Its value at bestStep.")
    patience: int | None = Field(
        default=None, description="Evaluations without improvement that ended training."
    )


class Recovery(_Model):
    reason: RecoveryReason = Field(description="What went wrong.")
    time: str = Field(description="When it was handled (RFC 3339).")
    step: int | None = Field(default=None, description="Checkpoint step the run resumed from.")
    attempt: int | None = Field(default=None, description="The attempt the failure happened in.")
    pod: str | None = Field(
        default=None, description="The trainer pod that failed, when one pod did."
    )
    message: Message = Field(default="", description="Details, e.g. the new plan after an OOM.")

    @model_validator(mode="before")
    @classmethod
    def _pod_written_in_message(cls, data: Any) -> Any:
        """Statuses written before `pod` existed name the pod only in the message
        ("pod demo-a1-0-x7k preempted")."""
        if isinstance(data, dict) and data.get("pod") is None:
            message = data.get("message")
            if isinstance(message, str) and message.startswith("pod "):
                data = {**data, "pod": message.split(" ", 2)[1]}
        return data


class CostStatus(_Model):
    accrued_usd: float = Field(default=0.0, alias="accruedUSD", description="Spent so far.")
    estimated_usd: float | None = Field(
        default=None, alias="estimatedUSD", description="Planned total."
    )
    rate_usd_per_hour: float | None = Field(
        default=None, alias="rateUSDPerHour", description="Current spend rate."
    )
    updated_at: str | None = Field(default=None, description="When accruedUSD was last updated.")


class FineTuneJobStatus(_Model):
    phase: Phase = Field(default=Phase.PENDING, description="Where the job is in its life.")
    observed_generation: int | None = Field(
        default=None, description="Latest spec generation the operator acted on."
    )
    message: Message | None = Field(default=None, description="Latest human-readable news.")
    conditions: list[Condition] = Field(default_factory=list, description="Current conditions.")
    plan: PlanStatus | None = Field(default=None, description="The plan being executed.")
    queue: QueueStatus | None = Field(
        default=None, description="Where the job waits for GPUs; set only while it is Queued."
    )
    upstream: UpstreamStatus | None = Field(
        default=None, description="The FineTuneJob an `ftj://` model comes from."
    )
    stage_in: StageInStatus | None = Field(
        default=None, description="What the stage-in step fetched and measured."
    )
    export: ExportStatus | None = Field(
        default=None, description="What the export step wrote (spec.output.gguf)."
    )
    stage_out: StageOutStatus | None = Field(
        default=None, description="What the stage-out step uploaded (an `s3://` output)."
    )
    progress: ProgressStatus | None = Field(default=None, description="Training progress.")
    checkpoint: CheckpointStatus | None = Field(default=None, description="Newest checkpoint.")
    early_stopped: EarlyStoppedStatus | None = Field(
        default=None,
        description="Set when spec.training.earlyStopping ended training before its last step.",
    )
    attempt: int = Field(
        default=0, description="Trainer launches so far (names the current batch Job)."
    )
    restarts: int = Field(default=0, description="Trainer relaunches so far.")
    failed_layouts: list[str] = Field(
        default_factory=list,
        description="Layouts (pool/method/GPUs/micro-batch/checkpointing) that ran out of memory.",
    )
    recoveries: list[Recovery] = Field(
        default_factory=list,
        description="Handled failures: every one of the current attempt and of the "
        "preemptions in a row at the end (each starts an attempt), and the latest of earlier "
        "attempts (recoveryCounts has them all).",
    )
    recovery_counts: dict[str, int] = Field(
        default_factory=dict, description="Handled failures so far, by reason."
    )
    trainer_pods: list[str] = Field(
        default_factory=list,
        description=(
            "Trainer pods of the current attempt seen at the last look; a pod that is gone "
            "without a recorded end was replaced (counted as a recovery)."
        ),
    )
    cost: CostStatus | None = Field(default=None, description="Money spent and planned.")
    start_time: str | None = Field(default=None, description="When training first started.")
    completion_time: str | None = Field(default=None, description="When the job finished.")


class FineTuneJob(_Model):
    api_version: Literal["kubetune.io/v1alpha1"] = Field(
        default="kubetune.io/v1alpha1", description="kubetune.io/v1alpha1"
    )
    kind: Literal["FineTuneJob"] = Field(default="FineTuneJob", description="FineTuneJob")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Object metadata.")
    spec: FineTuneJobSpec = Field(description="Desired state.")
    status: FineTuneJobStatus | None = Field(default=None, description="Observed state.")


# --------------------------------------------------------------------------- GPUPool


class Toleration(_Model):
    key: str | None = Field(default=None, description="Taint key.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Match operator.")
    value: str | None = Field(default=None, description="Taint value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect; empty matches all."
    )


class LabelSelectorRequirement(_Model):
    key: str = Field(description="Label key.", min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the label's value relates to `values`."
    )
    values: list[str] = Field(
        default_factory=list,
        description="Values for In and NotIn (at least one); empty for Exists and DoesNotExist.",
    )

    @model_validator(mode="after")
    def _values_fit_the_operator(self) -> LabelSelectorRequirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs at least one value")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        return self

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.operator == "Exists":
            return present
        if self.operator == "DoesNotExist":
            return not present
        inside = present and labels[self.key] in self.values
        return inside if self.operator == "In" else not inside

    def describe(self) -> str:
        if self.operator == "Exists":
            return self.key
        if self.operator == "DoesNotExist":
            return f"!{self.key}"
        word = "in" if self.operator == "In" else "notin"
        return f"{self.key} {word} ({','.join(self.values)})"


class LabelSelector(_Model):
    """Kubernetes' label selector: every matchLabels pair and every expression must hold."""

    match_labels: dict[str, str] = Field(
        default_factory=dict, description="Labels that must all be present with these values."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, description="Requirements that must all hold."
    )

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            e.matches(labels) for e in self.match_expressions
        )

    def describe(self) -> str:
        """The selector as `kubectl get -l` takes it (empty: everything)."""
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        return ",".join(parts + [e.describe() for e in self.match_expressions])


def _facts_optional_for_known_products(schema: dict[str, Any]) -> None:
    """In the CRD, memoryGiB and bf16TFLOPS may be left out for a product kubetune knows,
    and the other numbers have no schema default: the apiserver would store it, and the
    product's own figure could not take its place."""
    schema["required"] = [k for k in schema.get("required", []) if k not in GPU_FACT_KEYS]
    for prop in schema.get("properties", {}).values():
        prop.pop("default", None)
    known = ", ".join(f"'{p}'" for p in KNOWN_GPUS)
    schema.update(
        _validations(
            _cel(
                f"(has(self.memoryGiB) && has(self.bf16TFLOPS)) || self.product in [{known}]",
                "spec.gpu.memoryGiB and spec.gpu.bf16TFLOPS are required for a GPU product "
                f"kubetune does not know; it knows {', '.join(KNOWN_GPUS)}",
            )
        )
    )


GPU_FACT_KEYS = ("memoryGiB", "bf16TFLOPS")


class GPUSpec(_Model):
    """The GPU of a pool. For a product in `kubetune.api.gpus.KNOWN_GPUS` (H100, H200, A100,
    L40S, A40, A10, A10G, L4, RTX 4090) every number may be left out: the datasheet's is
    used, and any number given overrides it."""

    model_config = ConfigDict(json_schema_extra=_facts_optional_for_known_products)

    product: str = Field(
        description="GPU product as GPU feature discovery labels it, e.g. NVIDIA-H100-80GB-HBM3; "
        "for a product kubetune knows, the numbers below default to its datasheet's."
    )
    memory_gib: float = Field(gt=0, alias="memoryGiB", description="Memory per GPU (GiB).")
    bf16_tflops: float = Field(
        gt=0, alias="bf16TFLOPS", description="Dense bf16 tensor-core TFLOPS per GPU."
    )

    memory_bandwidth_gbps: float = Field(
        default=0,
        ge=0,
        alias="memoryBandwidthGBps",
        description="HBM/GDDR bandwidth (GB/s); default: the product's, else 0 (unknown).",
    )
    interconnect: Literal["nvlink", "pcie"] = Field(
        default="pcie",
        description="GPU-to-GPU link inside a node; default: the product's, else pcie.",
    )
    interconnect_gbps: float = Field(
        default=64,
        ge=0,
        alias="interconnectGBps",
        description="Intra-node GPU link (GB/s); default: the product's, else 64.",
    )

    @model_validator(mode="before")
    @classmethod
    def _known_product_defaults(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        names = {f.alias or n: n for n, f in cls.model_fields.items()}

        def given(key: str) -> bool:
            return key in data or names[key] in data

        facts = KNOWN_GPUS.get(str(data.get("product")))
        if facts is None:
            missing = [k for k in GPU_FACT_KEYS if not given(k)]
            if missing:
                raise ValueError(
                    f"gpu.{' and gpu.'.join(missing)} required: kubetune does not know GPU "
                    f"product {data.get('product')!r}. To fix: give the numbers, or use the "
                    f"name GPU feature discovery gives a GPU it knows ({', '.join(KNOWN_GPUS)})"
                )
            return data
        return {**{k: v for k, v in facts.spec_fields().items() if not given(k)}, **data}


class GPUPoolSpec(_Model):
    """A set of identical GPU nodes the planner may place jobs on."""

    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Labels that select this pool's nodes; default (key left out): "
        f"{{{GPU_PRODUCT_LABEL}: <gpu.product>}}, the label GPU feature discovery puts on "
        "GPU nodes. {} selects every node.",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations trainer pods need on these nodes."
    )
    namespace_selector: LabelSelector | None = Field(
        default=None,
        description="Namespaces whose FineTuneJobs may use this pool (their labels must "
        "match); omitted or empty: every namespace. The planner never places a job on a pool "
        "its namespace may not use, so only such pools' tolerations reach its pods.",
    )
    gpu: GPUSpec = Field(description="The GPU model in this pool.")
    gpus_per_node: int = Field(alias="gpusPerNode", ge=1, le=64, description="GPUs per node.")
    max_nodes: int = Field(ge=1, description="Most nodes a job may use (pool size).")
    price_per_gpu_hour: float = Field(
        ge=0, alias="pricePerGPUHour", description="US dollars per GPU-hour."
    )
    spot: bool = Field(default=False, description="Nodes can be preempted.")
    network_gbps: float = Field(
        default=100, gt=0, alias="networkGbps", description="Inter-node bandwidth (Gbit/s)."
    )

    @model_validator(mode="before")
    @classmethod
    def _select_the_products_nodes(cls, data: Any) -> Any:
        """A pool that leaves `nodeSelector` out selects the nodes GPU feature discovery
        labels with its product. The operator fills this in, not the CRD: a schema default
        would be stored, and could not follow a later change of `gpu.product`. An explicit
        `nodeSelector: {}` stays empty (every node)."""
        if not isinstance(data, Mapping) or "nodeSelector" in data or "node_selector" in data:
            return data
        gpu = data.get("gpu")
        product = gpu.product if isinstance(gpu, GPUSpec) else None
        if isinstance(gpu, Mapping):
            product = gpu.get("product")
        if not isinstance(product, str) or not product:
            return data  # the gpu field's own validation says what is wrong
        return {**data, "nodeSelector": {GPU_PRODUCT_LABEL: product}}


class GPUPoolStatus(_Model):
    observed_generation: int | None = Field(default=None, description="Spec generation seen.")
    nodes: int = Field(default=0, description="Ready nodes matching the selector.")
    allocatable_gpus: int = Field(default=0, alias="allocatableGPUs", description="GPUs.")
    free_gpus: int = Field(default=0, alias="freeGPUs", description="GPUs not held by pods.")
    free_gpus_per_node: list[int] = Field(
        default_factory=list, alias="freeGPUsPerNode", description="Free GPUs on each node."
    )
    node_memory_gib: float | None = Field(
        default=None,
        alias="nodeMemoryGiB",
        description="Allocatable memory of the pool's largest ready node (GiB; unset: not "
        "known): a trainer pod asking for more can never be scheduled.",
    )
    gpu_memory_gib: float | None = Field(
        default=None,
        alias="gpuMemoryGiB",
        description="Memory per GPU the planner uses: spec.gpu.memoryGiB, or the product's.",
    )
    updated_at: str | None = Field(default=None, description="When this was computed.")
    conditions: list[Condition] = Field(default_factory=list, description="Pool conditions.")


class GPUPool(_Model):
    api_version: Literal["kubetune.io/v1alpha1"] = Field(
        default="kubetune.io/v1alpha1", description="kubetune.io/v1alpha1"
    )
    kind: Literal["GPUPool"] = Field(default="GPUPool", description="GPUPool")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Object metadata.")
    spec: GPUPoolSpec = Field(description="Pool hardware and price.")
    status: GPUPoolStatus | None = Field(default=None, description="Live capacity.")

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))
