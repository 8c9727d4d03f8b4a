"""The `kubetune` CLI, run in-process through click's test runner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from kubetune.cli import main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
JOBS = sorted(p for p in (ROOT / "examples").glob("*.yaml") if p.name != "gpupools.yaml")


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_estimate_json_has_total_and_breakdown() -> None:
    code, out = invoke(
        "estimate",
        "--model",
        "meta-llama/Llama-3.1-8B",
        "--method",
        "qlora",
        "--lora-rank",
        "16",
        "--lora-targets",
        "q_proj,v_proj",
        "--micro-batch",
        "2",
        "--seq-len",
        "4096",
        "--gpus",
        "1",
        "--sharding",
        "none",
        "--precision",
        "bf16",
        "--optimizer",
        "paged-adamw-8bit",
        "--no-grad-ckpt",
        "--json",
    )
    assert code == 0, out
    data = json.loads(out)
    assert data["perGPUBytes"] == sum(data["breakdown"].values())
    assert data["perGPUGiB"] == pytest.approx(data["perGPUBytes"] / 1024**3, rel=1e-3)
    assert data["trainableParams"] == 32 * 16 * (4096 + 4096) + 32 * 16 * (4096 + 1024)
    assert data["setup"]["method"] == "qlora"


def test_estimate_counts_a_dpo_micro_batch_of_pairs_as_twice_the_sequences() -> None:
    def estimate(*flags: str) -> dict[str, Any]:
        code, out = invoke("estimate", "--model", "Qwen/Qwen2.5-0.5B", "--json", *flags)
        assert code == 0, out
        return dict(json.loads(out))

    dpo = estimate("--objective", "dpo", "--micro-batch", "2")
    sft = estimate("--micro-batch", "4")
    assert dpo["objective"] == "dpo" and sft["objective"] == "sft"
    assert dpo["perGPUBytes"] == sft["perGPUBytes"]
    assert dpo["perGPUBytes"] > estimate("--micro-batch", "2")["perGPUBytes"]
    code, out = invoke("estimate", "--model", "Qwen/Qwen2.5-0.5B", "--objective", "dpo")
    assert code == 0 and "micro-batch 1 pairs (2 sequences)" in out, out


def test_estimate_counts_the_gradients_of_accumulated_micro_batches() -> None:
    def estimate(*flags: str) -> dict[str, Any]:
        code, out = invoke(
            "estimate", "--model", "Qwen/Qwen2.5-0.5B", "--method", "full", "--seq-len", "8192",
            "--json", *flags,
        )  # fmt: skip
        assert code == 0, out
        return dict(json.loads(out))

    one = estimate()
    four = estimate("--grad-accumulation", "4")
    assert one["setup"]["gradAccumulation"] == 1 and four["setup"]["gradAccumulation"] == 4
    assert one["breakdown"]["gradients"] == 0  # the loss is the peak: no gradient yet
    assert four["breakdown"]["gradients"] == four["totalParams"] * 2
    # DPO: accumulation counts micro-batches of pairs, whatever their rows
    dpo = estimate("--objective", "dpo", "--micro-batch", "2", "--grad-accumulation", "4")
    assert dpo["setup"]["microBatch"] == 4 and dpo["setup"]["gradAccumulation"] == 4
    code, out = invoke("estimate", "--model", "Qwen/Qwen2.5-0.5B", "--grad-accumulation", "0")
    assert code != 0 and "--grad-accumulation" in out, out
    code, out = invoke("estimate", "--model", "Qwen/Qwen2.5-0.5B", "--grad-accumulation", "2")
    assert code == 0 and "× 2 accumulated" in out, out


def test_estimate_from_config_file(tmp_path: Path) -> None:
    cfg = ROOT / "tests/unit/fixtures/configs"
    config = sorted(cfg.glob("*.json"))[0]
    code, out = invoke("estimate", "--config", str(config), "--method", "full", "--json")
    assert code == 0, out
    assert json.loads(out)["perGPUBytes"] > 0


def test_checkpointing_and_precision_flags_change_the_estimate() -> None:
    def gib(*flags: str) -> float:
        code, out = invoke("estimate", "--model", "Qwen/Qwen2.5-7B", "--json", *flags)
        assert code == 0, out
        return float(json.loads(out)["perGPUGiB"])

    assert gib("--no-grad-ckpt") > gib("--grad-ckpt")
    assert gib("--method", "full", "--precision", "amp-bf16") > gib(
        "--method", "full", "--precision", "bf16"
    )
    assert gib("--method", "full", "--gpus", "8") < gib("--method", "full", "--gpus", "1")


def test_estimate_errors_are_actionable() -> None:
    code, out = invoke("estimate", "--model", "acme/not-a-model")
    assert code != 0 and "To fix" in out
    code, out = invoke("estimate", "--model", "Qwen/Qwen2.5-7B", "--lora-targets", "nonsense")
    assert code != 0 and "q_proj" in out
    code, out = invoke("estimate")
    assert code != 0 and "--model" in out


def test_a_file_of_several_jobs_plans_each_and_chains_resolve_within_it() -> None:
    """As `kubectl apply -f` takes each job of a file, `kubetune plan` plans each, in order."""
    example = str(ROOT / "examples/sft-then-dpo.yaml")
    code, out = invoke("plan", example)
    assert code == 0, out
    sft, dpo = out.index("support-sft: "), out.index("support-dpo: meta-llama/Llama-3.1-8B")
    assert sft < dpo and out.count("steps ") == 2
    code, out = invoke("plan", example, "-o", "json")
    assert code == 0 and list(json.loads(out)) == ["support-sft", "support-dpo"]
    assert all(p["totalGPUs"] >= 1 for p in json.loads(out).values())
    code, out = invoke("plan", example, "--job", "nope")
    assert code != 0 and "no FineTuneJob 'nope'" in out
    # support-dpo's model is ftj://support-sft: planned as support-sft's model.
    code, out = invoke("plan", example, "--job", "support-dpo")
    assert code == 0 and "support-dpo: meta-llama/Llama-3.1-8B" in out, out


def test_list_models() -> None:
    code, out = invoke("estimate", "--list-models")
    assert code == 0
    assert len(out.splitlines()) >= 20
    assert "meta-llama/Llama-3.1-8B" in out


def _example_jobs() -> list[tuple[Path, list[str]]]:
    """Each example file's FineTuneJobs, with `--job NAME` where it holds several (each planned
    on its own, so that `--json` gives one plan)."""
    out = []
    for path in JOBS:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "FineTuneJob"]
        if len(docs) == 1:
            out.append((path, []))
        else:
            out += [(path, ["--job", d["metadata"]["name"]]) for d in docs]
    return out


@pytest.mark.parametrize(
    ("job", "which"), _example_jobs(), ids=lambda v: v.stem if isinstance(v, Path) else "-".join(v)
)
def test_plan_every_example(job: Path, which: list[str]) -> None:
    code, out = invoke("plan", str(job), *which)
    assert code == 0, out
    assert "* " in out and "objective" in out
    code, out = invoke("plan", str(job), *which, "--json")
    assert code == 0, out
    status = json.loads(out)
    assert status["totalGPUs"] == status["nodes"] * status["gpusPerNode"]
    assert status["estimatedCostUSD"] > 0
    assert json.loads(invoke("plan", str(job), *which, "-o", "json")[1]) == status
    assert yaml.safe_load(invoke("plan", str(job), *which, "-o", "yaml")[1]) == status


def test_plan_with_custom_pools(tmp_path: Path) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text(
        """
apiVersion: kubetune.io/v1alpha1
kind: GPUPool
metadata: {name: tiny}
spec:
  gpu: {product: T4, memoryGiB: 16, bf16TFLOPS: 65}
  gpusPerNode: 1
  maxNodes: 1
  pricePerGPUHour: 0.35
"""
    )
    code, out = invoke("plan", str(ROOT / "examples/llama-8b-full.yaml"), "--pools", str(pools))
    assert code != 0
    assert "tiny:" in out and "To fix:" in out


def test_plan_reads_the_pools_kubectl_prints_from_stdin() -> None:
    """`kubectl get gpupools -o yaml | kubetune plan JOB --pools -`: a List of live objects,
    with the server's metadata and the operator's status."""
    pools = [d for d in yaml.safe_load_all((ROOT / "examples/gpupools.yaml").read_text()) if d]
    for pool in pools:
        pool["metadata"].update(
            uid="0b3f", resourceVersion="812", generation=1,
            managedFields=[{"manager": "kubectl", "operation": "Apply"}],
        )  # fmt: skip
        pool["status"] = {
            "observedGeneration": 1, "nodes": 2, "allocatableGPUs": 16, "freeGPUs": 16,
            "freeGPUsPerNode": [8, 8], "updatedAt": "2026-11-24T06:00:00Z",
            "conditions": [{"type": "Valid", "status": "True", "reason": "PoolValid",
                            "message": "", "lastTransitionTime": "2026-11-24T05:00:00Z"}],
        }  # fmt: skip
    listed = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": pools})
    job = str(ROOT / "examples/mistral-7b-lora.yaml")

    result = CliRunner().invoke(main, ["plan", job, "--pools", "-"], input=listed)

    assert result.exit_code == 0, result.output
    assert f"pools: {len(pools)} from stdin" in result.output
    default = CliRunner().invoke(main, ["plan", job])
    assert "pools: the built-in catalog" in default.output
    # The same plan as from the file the pools came from.
    from_file = CliRunner().invoke(
        main, ["plan", job, "--json", "--pools", str(ROOT / "examples/gpupools.yaml")]
    )
    from_stdin = CliRunner().invoke(main, ["plan", job, "--json", "--pools", "-"], input=listed)
    assert json.loads(from_stdin.output) == json.loads(from_file.output)


def test_plan_table_shows_every_pools_best_with_its_headroom() -> None:
    pools = [d for d in yaml.safe_load_all((ROOT / "examples/gpupools.yaml").read_text()) if d]
    long_name = "h100-sxm-reserved-capacity-us-east-1b"  # longer than any fixed column
    for pool in pools:
        if pool["metadata"]["name"] == "h100":
            pool["metadata"]["name"] = long_name
    listed = yaml.safe_dump_all(pools)
    job = str(ROOT / "examples/mistral-7b-lora.yaml")

    result = CliRunner().invoke(main, ["plan", job, "--pools", "-"], input=listed)

    assert result.exit_code == 0, result.output
    header, *rows = result.output.split("\n\n")[0].splitlines()[2:]
    assert "HEADROOM" in header.split()
    names = [row[2:].split()[0] for row in rows]
    # One row per pool that can run the job (none is rejected here), each pool once.
    assert sorted(names) == sorted(p["metadata"]["name"] for p in pools)
    for row in rows:
        cells = row[2:].split()
        assert len(cells) == len(header.split()), row  # nothing ran into the next column
        headroom = float(cells[header.split().index("HEADROOM")].rstrip("%"))
        assert 0 <= headroom < 100


def test_plan_takes_pools_from_one_place() -> None:
    job = str(ROOT / "examples/mistral-7b-lora.yaml")
    pools = str(ROOT / "examples/gpupools.yaml")
    both = CliRunner().invoke(main, ["plan", job, "--pools", pools, "--from-cluster"])
    assert both.exit_code != 0 and "pass one" in both.output
    stray = CliRunner().invoke(main, ["plan", job, "--context", "prod"])
    assert stray.exit_code != 0 and "only mean something with --from-cluster" in stray.output


def test_plan_without_pools_in_the_input_says_how_to_get_them() -> None:
    job = str(ROOT / "examples/mistral-7b-lora.yaml")
    empty = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": []})
    result = CliRunner().invoke(main, ["plan", job, "--pools", "-"], input=empty)
    assert result.exit_code != 0
    assert "stdin holds no GPUPool objects. To fix:" in result.output
    assert "kubectl get gpupools -o yaml" in result.output


def test_plan_default_objective_applies_only_to_jobs_without_one(tmp_path: Path) -> None:
    source = (ROOT / "examples/mistral-7b-lora.yaml").read_text()
    assert "    objective: cost\n" in source
    unset = tmp_path / "unset.yaml"
    unset.write_text(source.replace("    objective: cost\n", ""))
    plans = {}
    for default in ("cost", "time"):
        code, out = invoke("plan", str(unset), "--json", "--default-objective", default)
        assert code == 0, out
        plans[default] = json.loads(out)
    # Time buys speed with money: the two defaults pick different plans for this job.
    assert plans["time"]["estimatedDurationSeconds"] < plans["cost"]["estimatedDurationSeconds"]
    assert plans["cost"]["estimatedCostUSD"] < plans["time"]["estimatedCostUSD"]
    code, out = invoke("plan", str(unset))
    assert code == 0, out
    assert plans["cost"] == json.loads(invoke("plan", str(unset), "--json")[1])
    assert "objective cost (the default: the job sets no resources.objective)" in out
    # The job's own objective wins over the default.
    code, out = invoke("plan", str(ROOT / "examples/mistral-7b-lora.yaml"), "--json",
                       "--default-objective", "time")  # fmt: skip
    assert code == 0, out
    assert json.loads(out) == plans["cost"]
    code, out = invoke("plan", str(ROOT / "examples/mistral-7b-lora.yaml"))
    assert "objective cost\n" in out
    code, out = invoke("plan", str(unset), "--default-objective", "fast")
    assert code != 0 and "'fast' is not one of 'cost', 'time'" in out


def test_plan_rejects_invalid_job(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: kubetune.io/v1alpha1\nkind: FineTuneJob\nmetadata: {name: x}\n"
        "spec: {model: {uri: x/y}, dataset: {uri: pvc://a/b}, method: full, lora: {rank: 8}}\n"
    )
    code, out = invoke("plan", str(bad))
    assert code != 0
    assert "spec.lora" in out and "to fix" in out.lower()


def test_crds_command_matches_committed(tmp_path: Path) -> None:
    code, _ = invoke("crds", "--out", str(tmp_path))
    assert code == 0
    for path in tmp_path.iterdir():
        assert path.read_text() == (ROOT / "crds" / path.name).read_text()


def test_plan_names_the_memory_savers_it_chose(tmp_path: Path) -> None:
    """A 32k-token LoRA job on one 48 GiB GPU fits with the fused loss alone; without it,
    only with the chunked loss and activation offloading. The plan says so, and its JSON
    carries them."""
    job = tmp_path / "long.yaml"
    text = """
apiVersion: kubetune.io/v1alpha1
kind: FineTuneJob
metadata: {name: long-context}
spec:
  model: {uri: meta-llama/Llama-3.2-3B}
  dataset: {uri: pvc://data/long.jsonl, numExamples: 1000, avgTokensPerExample: 32768}
  method: lora
  training: {sequenceLength: 32768, globalBatchSize: 4, microBatchSize: 1FUSED}
  resources: {gpus: 1, pools: [l40s]}
"""
    job.write_text(text.replace("FUSED", ""))
    code, out = invoke("plan", str(job))
    assert code == 0, out
    assert "memory savers: fused cross-entropy\n" in out
    status = json.loads(invoke("plan", str(job), "-o", "json")[1])
    assert status["fusedCrossEntropy"] is True and status.get("activationOffloading") is None

    job.write_text(text.replace("FUSED", ", fusedCrossEntropy: false"))
    code, out = invoke("plan", str(job))
    assert code == 0, out
    assert "memory savers: chunked cross-entropy, activation offloading" in out
    status = json.loads(invoke("plan", str(job), "-o", "json")[1])
    assert status["chunkedCrossEntropy"] is True and status["activationOffloading"] is True
    assert status.get("fusedCrossEntropy") is None


def test_estimate_expresses_the_memory_savers() -> None:
    """The savers a published run may have used are flags of `estimate`, each moving the
    term it affects: the chunked loss the logits, offloading the activations, stacked
    experts the QLoRA weights of a MoE model."""

    def breakdown(*flags: str, model: str = "meta-llama/Llama-3.1-8B") -> dict[str, int]:
        code, out = invoke(
            "estimate", "--model", model, "--method", "qlora", "--seq-len", "8192", "--json", *flags
        )
        assert code == 0, out
        return dict(json.loads(out)["breakdown"])

    plain = breakdown()
    assert breakdown("--chunked-ce")["logits"] < 0.4 * plain["logits"]
    assert (
        breakdown("--chunked-ce", "--loss-chunk-tokens", "128")["logits"]
        < breakdown("--chunked-ce")["logits"]
    )
    assert breakdown("--activation-offload")["activations"] < plain["activations"]
    mixtral = ("--lora-dropout", "0")
    assert (
        breakdown("--linear-experts", *mixtral, model="mistralai/Mixtral-8x7B-v0.1")["weights"]
        < breakdown(*mixtral, model="mistralai/Mixtral-8x7B-v0.1")["weights"] / 2
    )


def test_plan_keeps_a_job_on_one_node_unless_told_the_class_is_read_write_many(
    tmp_path: Path,
) -> None:
    """As the operator by default: `auto` means a ReadWriteOnce checkpoint volume, so the
    8B full fine-tune (set ReadWriteMany in the example) stays on one node once its access
    mode is `auto`; `--read-write-many` lets it span nodes again."""
    doc = yaml.safe_load((ROOT / "examples/llama-8b-full.yaml").read_text())
    assert doc["spec"]["checkpoint"]["storage"]["accessMode"] == "ReadWriteMany"
    code, out = invoke("plan", str(ROOT / "examples/llama-8b-full.yaml"), "-o", "json")
    assert code == 0, out
    assert json.loads(out)["nodes"] == 2
    doc["spec"]["checkpoint"]["storage"]["accessMode"] = "auto"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    code, out = invoke("plan", str(job), "-o", "json")
    assert code == 0, out
    assert json.loads(out)["nodes"] == 1
    code, out = invoke("plan", str(job), "-o", "json", "--read-write-many")
    assert code == 0, out
    assert json.loads(out)["nodes"] == 2
    # Two GPUs on a pool of one-GPU nodes: only a layout over two nodes is left.
    pools = tmp_path / "pools.yaml"
    pools.write_text(
        """
apiVersion: kubetune.io/v1alpha1
kind: GPUPool
metadata: {name: singles}
spec:
  gpu: {product: H100, memoryGiB: 80, bf16TFLOPS: 989}
  gpusPerNode: 1
  maxNodes: 4
  pricePerGPUHour: 2.5
"""
    )
    doc["spec"]["resources"]["gpus"] = 2
    job.write_text(yaml.safe_dump(doc))
    code, out = invoke("plan", str(job), "--pools", str(pools))
    assert code != 0
    assert "singles: spans 2 nodes, but its checkpoint volume would be ReadWriteOnce" in out
    assert "To fix: if the checkpoint StorageClass offers ReadWriteMany" in out
