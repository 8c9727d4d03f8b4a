"""DPO (`training.objective: dpo`): preference data, the loss against TRL's, training with full,
LoRA and QLoRA, step-exact resume after SIGTERM, two FSDP2 processes, and step time vs SFT."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import statistics
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

import torch

from kubetune_trainer.__main__ import main
from kubetune_trainer.contract import EXIT_OK, EXIT_PREEMPTED
from kubetune_trainer.data import (
    IGNORE_INDEX,
    Pair,
    Record,
    prepare_preference_data,
    record_to_pair,
    truncate_pair,
)
from kubetune_trainer.dpo import dpo_loss
from kubetune_trainer.errors import DataError
from kubetune_trainer.recipe import DpoRecipe
from kubetune_trainer.tiny import make_preference_records, make_records, write_jsonl
from support.trainer import (
    checkpoint_names,
    load_config,
    read_log,
    step_losses,
    trainer_config,
    write_config,
)

pytestmark = pytest.mark.trainer

PARITY_TOLERANCE = 1e-5
RESUME_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def pref_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(
        tmp_path_factory.mktemp("data") / "pref.jsonl", make_preference_records(200, seed=1)
    )


def dpo_config(tmp: Path, model: Path, data: Path, method: str, **over: Any) -> dict[str, Any]:
    over.setdefault("training", {})
    over["training"] = {"objective": "dpo", "packing": False, **over["training"]}
    return trainer_config(tmp, model, data, method, **over)


def run_main(tmp: Path, cfg: dict[str, Any]) -> int:
    return main(["--config", str(write_config(tmp, cfg))])


# ------------------------------------------------------------------ data


def test_string_and_chat_pairs_mask_the_prompt(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    plain = record_to_pair(Record("x:1", make_preference_records(1)[0]), tok)
    assert plain.prompt[0] == tok.bos_token_id
    assert plain.chosen[-1] == plain.rejected[-1] == tok.eos_token_id
    chat = record_to_pair(Record("x:2", make_preference_records(1, chat=True)[0]), tok)
    prompt_text = tok.decode(chat.prompt)
    assert prompt_text.endswith("<|im_start|>assistant\n")
    assert tok.decode(chat.chosen).endswith("<|im_end|>\n")
    assert tok.decode(chat.chosen).lower() == tok.decode(chat.rejected).lower()
    # A prompt given as messages, answers as their own turns: the same pair.
    rec = make_preference_records(1, chat=True)[0]
    split = {
        "prompt": rec["chosen"][:1],
        "chosen": rec["chosen"][1:],
        "rejected": rec["rejected"][1:],
    }
    assert record_to_pair(Record("x:3", split), tok) == chat

    data = prepare_preference_data(
        [Record(f"x:{i}", r) for i, r in enumerate(make_preference_records(20))],
        tokenizer=tok,
        sequence_length=64,
        validation_split=0.25,
        seed=0,
    )
    assert data.stats.train_rows == 15 and data.stats.validation_rows == 5
    rows: Any = data.train
    for i in range(len(rows)):
        prompts = []
        for side in (rows.chosen, rows.rejected):
            ids, labels = side.input_ids[i], side.labels[i]
            n_prompt = next(k for k, x in enumerate(labels) if x != IGNORE_INDEX)
            assert labels[n_prompt:] == ids[n_prompt:]
            prompts.append(ids[:n_prompt])
        assert prompts[0] == prompts[1]  # a pair shares its prompt


def test_truncation_keeps_the_prompt_end_and_the_response_start() -> None:
    pair = Pair(prompt=list(range(100, 120)), chosen=list(range(10)), rejected=list(range(5)))
    same, cut = truncate_pair(pair, 64)
    assert same == pair and not cut
    short, cut = truncate_pair(pair, 24)  # prompt keeps max(24 - 10, 12) = 14 last tokens
    assert cut and short.prompt == list(range(106, 120))
    assert short.chosen == list(range(10)) and short.rejected == list(range(5))
    long_answer = Pair(prompt=list(range(100, 120)), chosen=list(range(40)), rejected=[1, 2])
    got, _ = truncate_pair(long_answer, 24)  # prompt keeps half the row, the answer the rest
    assert got.prompt == list(range(108, 120)) and got.chosen == list(range(12))


def test_bad_preference_records_fail_with_where(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    records = [
        Record("d.jsonl:1", {"prompt": "p", "chosen": "a"}),
        Record("d.jsonl:2", {"prompt": "p", "chosen": "a", "rejected": 3}),
        Record("d.jsonl:3", {"chosen": [{"role": "user", "content": "a"}], "rejected": []}),
    ]
    with pytest.raises(DataError) as e:
        prepare_preference_data(
            records, tokenizer=tok, sequence_length=64, validation_split=0, seed=0
        )
    text = str(e.value)
    assert "3 bad record(s)" in text
    assert "d.jsonl:1" in text and "d.jsonl:2" in text and "d.jsonl:3" in text


def test_chunked_sequence_logps_equal_plain(tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    from kubetune_trainer.loss import ChunkedLoss, sequence_logps

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (4, 150), generator=g)
    labels = ids.clone()
    labels[:, :30] = IGNORE_INDEX
    labels[2, 100:] = IGNORE_INDEX
    mask = torch.ones_like(ids)
    mask[2, 100:] = 0
    plain = sequence_logps(model, input_ids=ids, labels=labels, attention_mask=mask)
    twin = copy.deepcopy(model)
    chunked = ChunkedLoss.install(twin)
    chunked.chunk = 64  # several chunks per row, chunks straddling rows
    got = sequence_logps(twin, input_ids=ids, labels=labels, attention_mask=mask, chunked=chunked)
    # Sums of ~120 log-probabilities (about -700): fp32 summation order, relative 1e-6.
    assert torch.allclose(plain, got, rtol=1e-6, atol=PARITY_TOLERANCE), (plain, got)


# ------------------------------------------------------------------ the loss against TRL


def _trl_loss_and_grads(
    policy: Any, ref: Any, batch: Any, tok: Any, records: Any, tmp: Path, **dpo: Any
) -> tuple[torch.Tensor, dict[str, Any], dict[str, torch.Tensor]]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp / "trl"), report_to="none", use_cpu=True, bf16=False, **dpo)
    trainer = DPOTrainer(
        model=policy,
        ref_model=ref,
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=tok,
    )
    model: Any = trainer.model
    if ref is None and "ref" in model.peft_config:
        # TRL takes a PEFT model it is given as an adapter to re-train and keeps its initial
        # copy as the reference; the trainer's reference is the base (adapters off).
        model.delete_adapter("ref")
    model.train()
    inputs = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "completion_mask": (batch.labels != IGNORE_INDEX).long(),
    }
    loss = trainer._compute_loss(model, inputs, False)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), metrics, grads


@pytest.mark.parametrize(
    ("method", "label_smoothing", "pairs"),
    [("full", 0.0, 4), ("lora", 0.0, 4), ("lora", 0.2, 1), ("full", 0.3, 1)],
)
def test_loss_rewards_and_gradients_equal_trl(
    tmp_path: Path, tiny_llama: Path, method: str, label_smoothing: float, pairs: int
) -> None:
    """The recipe's DPO step (its data, its reference, its loss) against TRL's
    `DPOTrainer._compute_loss` on the same weights and batch. TRL 1.16's `sigmoid` loss has no
    label smoothing; its `aot` loss is the same smoothed sigmoid on sorted log-ratios, which
    for one pair is exactly conservative DPO, so smoothing is checked with one pair."""
    from transformers import AutoModelForCausalLM

    records = make_preference_records(16, seed=3)
    data = write_jsonl(tmp_path / "pref.jsonl", records)
    cfg = dpo_config(
        tmp_path,
        tiny_llama,
        data,
        method,
        lora=None if method == "full" else {"rank": 4, "alpha": 8, "dropout": 0.0},
        training={
            "micro_batch_size": pairs,
            "gradient_accumulation": 1,
            "global_batch_size": pairs,
            "dpo": {"beta": 0.3, "label_smoothing": label_smoothing},
        },
        metrics={"port": -1},
    )
    recipe = DpoRecipe(load_config(cfg))
    recipe.setup()
    try:
        # Move the policy away from the reference, so the log-ratios are not all zero.
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in recipe.model.named_parameters():
                if p.requires_grad and (method == "full" or "lora_B" in name):
                    p.add_(torch.randn_like(p) * 0.05)
        policy = copy.deepcopy(recipe.built.core)
        batch = recipe.batches.next_step()[0]
        terms = recipe._dpo_terms(batch)
        terms.losses.mean().backward()
        ours = {n: p.grad for n, p in recipe.built.core.named_parameters() if p.requires_grad}
    finally:
        recipe.cleanup()
    ref = (
        AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
        if method == "full"
        else None
    )
    loss, metrics, theirs = _trl_loss_and_grads(
        policy,
        ref,
        batch,
        recipe.tokenizer,
        records,
        tmp_path,
        beta=0.3,
        label_smoothing=label_smoothing,
        loss_type=["sigmoid" if label_smoothing == 0 else "aot"],
    )
    assert sorted(ours) == sorted(theirs)
    errors = {
        "loss": abs(float(terms.losses.mean()) - float(loss)),
        "rewards/chosen": abs(float(terms.chosen_rewards.mean()) - metrics["rewards/chosen"]),
        "rewards/rejected": abs(float(terms.rejected_rewards.mean()) - metrics["rewards/rejected"]),
        "rewards/margins": abs(
            float((terms.chosen_rewards - terms.rejected_rewards).mean())
            - metrics["rewards/margins"]
        ),
        "rewards/accuracies": abs(
            float((terms.chosen_rewards > terms.rejected_rewards).float().mean())
            - metrics["rewards/accuracies"]
        ),
        "gradients": max(float((ours[n] - theirs[n]).abs().max()) for n in ours),
    }
    print(
        f"DPO vs TRL ({method}, label_smoothing {label_smoothing}, {pairs} pairs): loss "
        f"{float(loss):.6f}, margin {metrics['rewards/margins']:.4f}, max errors "
        + ", ".join(f"{k} {v:.2g}" for k, v in errors.items())
    )
    assert metrics["rewards/margins"] != 0.0
    assert all(v <= PARITY_TOLERANCE for v in errors.values()), errors


def test_the_kept_reference_is_used_only_by_the_run_it_was_computed_for(tmp_path: Path) -> None:
    from kubetune_trainer.dpo import REFERENCE_FILE, read_reference, write_reference

    values = {"train": [-1.0, -2.0, -3.0, -4.0], "validation": [-5.0, -6.0]}
    sizes = {"train": 2, "validation": 1}
    write_reference(tmp_path / "ckpt", "f1", values)
    assert read_reference(tmp_path / "ckpt", "f1", sizes) == values
    assert read_reference(tmp_path / "ckpt", "f2", sizes) is None  # another run's
    assert read_reference(tmp_path / "ckpt", "f1", {"train": 3, "validation": 1}) is None
    assert read_reference(tmp_path / "ckpt", "f1", {"train": 2}) is None
    assert read_reference(tmp_path / "none", "f1", sizes) is None
    (tmp_path / "ckpt" / REFERENCE_FILE).write_text('{"fingerprint": "f1", "values": ')
    assert read_reference(tmp_path / "ckpt", "f1", sizes) is None  # torn: computed again
    assert checkpoint_names(tmp_path / "ckpt") == [REFERENCE_FILE]


def test_dpo_loss_formula_edge_cases() -> None:
    zero = torch.zeros(3)
    terms = dpo_loss(zero, zero, zero, zero, beta=0.1, label_smoothing=0.1)
    assert torch.allclose(terms.losses, torch.full((3,), math.log(2)))
    assert not bool((terms.chosen_rewards > terms.rejected_rewards).any())  # ties: not accurate


# ------------------------------------------------------------------ training


@pytest.mark.parametrize(
    ("method", "precision", "lr"),
    [("lora", "fp32", 5e-3), ("qlora", "bf16", 5e-3), ("full", "fp32", 1e-3)],
)
def test_dpo_trains_and_held_out_reward_accuracy_rises(
    tmp_path: Path, tiny_llama: Path, pref_data: Path, method: str, precision: str, lr: float
) -> None:
    cfg = dpo_config(
        tmp_path,
        tiny_llama,
        pref_data,
        method,
        dataset={"validation_split": 0.2},
        training={"max_steps": 12, "total_steps": 12, "learning_rate": lr, "precision": precision},
        checkpoint={"interval_steps": 2},
    )
    recipe = DpoRecipe(load_config(cfg))
    recipe.setup()
    try:
        recipe.evaluate()  # before the first step: policy = reference, every reward is 0
        before = dict(recipe.metrics.values)
    finally:
        recipe.cleanup()
    os.remove(tmp_path / "metrics.jsonl")
    assert run_main(tmp_path, cfg) == EXIT_OK
    evals = read_log(tmp_path / "metrics.jsonl", "eval")
    curve = [(int(e["step"]), e["eval_dpo_reward_accuracy"]) for e in evals]
    after = evals[-1]
    print(
        f"DPO {method}: held-out reward accuracy {before['eval_dpo_reward_accuracy']:.3f} "
        f"(step 0, rewards all 0) → {after['eval_dpo_reward_accuracy']:.3f} at step 12; by step "
        f"{curve}; eval loss {before['eval_loss']:.4f} → {after['eval_loss']:.4f}; margin "
        f"{before['eval_dpo_reward_margin']:.4f} → {after['eval_dpo_reward_margin']:.4f}"
    )
    assert before["eval_dpo_reward_accuracy"] == 0.0
    assert math.isclose(before["eval_loss"], math.log(2), abs_tol=1e-4)
    assert after["eval_dpo_reward_accuracy"] >= 0.9
    assert after["eval_loss"] < math.log(2) - 0.1
    assert after["eval_dpo_reward_margin"] > 0.1
    steps = read_log(tmp_path / "metrics.jsonl", "step")
    assert all(math.isfinite(s["dpo_reward_accuracy"]) for s in steps)
    summary = json.loads((tmp_path / "out" / "trainer_summary.json").read_text())
    assert summary["step"] == 12
    text = _scrape(recipe)
    assert "kubetune_trainer_dpo_reward_accuracy" in text


def _scrape(recipe: DpoRecipe) -> str:
    from prometheus_client import generate_latest

    return generate_latest(recipe.metrics.registry).decode()


def _signal_at_policy_forward(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """A real SIGTERM during the n-th training micro-batch's policy forward."""
    original = DpoRecipe._policy_logps
    calls = {"n": 0}

    def forward(self: DpoRecipe, batch: Any) -> torch.Tensor:
        if self.model.training:
            calls["n"] += 1
            if calls["n"] == n:
                os.kill(os.getpid(), signal.SIGTERM)
        return original(self, batch)

    monkeypatch.setattr(DpoRecipe, "_policy_logps", forward)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_dpo_resumes_step_exactly_after_sigterm(
    tmp_path: Path,
    tiny_llama: Path,
    pref_data: Path,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
) -> None:
    """SIGTERM between the micro-batches of step 4: step-3 is written, and the resumed run
    reproduces the uninterrupted loss and reward curves (LoRA dropout on: the RNG is restored
    too; full: the reference computed at the first start is read back from the volume)."""
    base: dict[str, Any] = {
        "training": {"max_steps": 8, "learning_rate": 5e-3 if method == "lora" else 1e-3},
        "checkpoint": {"interval_steps": None},
    }
    a = dpo_config(tmp_path / "a", tiny_llama, pref_data, method, **base)
    assert run_main(tmp_path / "a", a) == EXIT_OK

    b = dpo_config(tmp_path / "b", tiny_llama, pref_data, method, **base)
    _signal_at_policy_forward(monkeypatch, 2 * 3 + 1)
    assert run_main(tmp_path / "b", b) == EXIT_PREEMPTED
    monkeypatch.undo()
    kept = ["dpo-reference.json"] if method == "full" else []
    assert checkpoint_names(tmp_path / "b" / "ckpt") == [*kept, "step-3"]
    assert run_main(tmp_path / "b", b) == EXIT_OK
    sources = [x["source"] for x in read_log(tmp_path / "b" / "metrics.jsonl", "dpo_reference")]
    assert sources == (["computed", "read"] if method == "full" else [])

    want = step_losses(tmp_path / "a" / "metrics.jsonl")
    got = step_losses(tmp_path / "b" / "metrics.jsonl")
    assert sorted(got) == sorted(want) == list(range(1, 9))
    diff = max(abs(want[s] - got[s]) for s in want)
    margins = {
        name: {
            int(x["step"]): x["dpo_reward_margin"]
            for x in read_log(tmp_path / name / "metrics.jsonl", "step")
        }
        for name in ("a", "b")
    }
    margin_diff = max(abs(margins["a"][s] - margins["b"][s]) for s in want)
    print(f"DPO {method} resume: max |loss diff| {diff:.3g}, max |margin diff| {margin_diff:.3g}")
    assert diff <= RESUME_TOLERANCE and margin_diff <= RESUME_TOLERANCE


# ------------------------------------------------------------------ two processes


def test_two_fsdp_processes_follow_one(
    tmp_path: Path, tiny_llama: Path, pref_data: Path, run_launcher: Any
) -> None:
    """FSDP2 on two processes, LoRA (reference = adapters off under FSDP) and full
    (precomputed reference split over the ranks): the one-process curve with the same global
    batch of pairs."""
    for method in ("lora", "full"):
        over: dict[str, Any] = {
            "training": {
                "micro_batch_size": 2,
                "gradient_accumulation": 1,
                "max_steps": 5,
                "learning_rate": 5e-3 if method == "lora" else 1e-3,
            },
            "dataset": {"validation_split": 0.1},
        }
        if method == "lora":
            over["lora"] = {"rank": 4, "alpha": 8, "dropout": 0.0}
        two = dpo_config(tmp_path / method / "two", tiny_llama, pref_data, method, **over)
        proc = run_launcher(write_config(tmp_path / method / "two", two), nproc=2)
        assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
        over["training"]["gradient_accumulation"] = 2
        one = dpo_config(tmp_path / method / "one", tiny_llama, pref_data, method, **over)
        assert run_main(tmp_path / method / "one", one) == EXIT_OK
        want = step_losses(tmp_path / method / "one" / "metrics.jsonl")
        got = step_losses(tmp_path / method / "two" / "metrics.jsonl")
        assert sorted(want) == sorted(got) == list(range(1, 6))
        diff = max(abs(want[s] - got[s]) for s in want)
        evals = [
            read_log(tmp_path / method / name / "metrics.jsonl", "eval")[-1]
            for name in ("one", "two")
        ]
        eval_diff = abs(evals[0]["eval_dpo_reward_margin"] - evals[1]["eval_dpo_reward_margin"])
        print(
            f"DPO {method} 2 processes vs 1: max |loss diff| {diff:.3g}, "
            f"eval margin {eval_diff:.3g}"
        )
        assert diff <= 1e-4 and eval_diff <= 1e-4
        start = read_log(tmp_path / method / "two" / "metrics.jsonl", "start")[0]
        assert start["objective"] == "dpo" and start["world_size"] == 2


# ------------------------------------------------------------------ step time


def test_dpo_step_time_against_sft(tmp_path: Path, tiny_llama: Path, pref_data: Path) -> None:
    """DPO does two rows per pair plus a reference forward (LoRA); SFT on the same model and
    the same prompts/answers (the chosen side as alpaca-like records, unpacked)."""
    sft_records = [
        {"instruction": r["prompt"], "output": r["chosen"]}
        for r in make_preference_records(200, seed=1)
    ]
    assert make_records("alpaca", 1)  # the SFT tiny data still builds
    sft_data = write_jsonl(tmp_path / "sft.jsonl", sft_records)
    over: dict[str, Any] = {"training": {"max_steps": 12, "packing": False}}
    times: dict[str, float] = {}
    for name, data, objective in (("sft", sft_data, "sft"), ("dpo", pref_data, "dpo")):
        cfg = trainer_config(
            tmp_path / name,
            tiny_llama,
            data,
            "lora",
            **{**over, "training": {**over["training"], "objective": objective}},
        )
        assert run_main(tmp_path / name, cfg) == EXIT_OK
        steps = read_log(tmp_path / name / "metrics.jsonl", "step")
        times[name] = statistics.median(s["step_seconds"] for s in steps[2:])
    print(
        f"median step time on the tiny Llama, LoRA, 4 rows/pairs per step: SFT "
        f"{times['sft'] * 1e3:.1f} ms, DPO {times['dpo'] * 1e3:.1f} ms "
        f"({times['dpo'] / times['sft']:.2f}x)"
    )
    assert times["dpo"] > 0 and times["sft"] > 0
