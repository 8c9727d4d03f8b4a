"""What FSDP2 holds between the micro-batches of an accumulated step, as the memory estimate
counts it (`kubetune.planning.estimator._accumulated_gradient_bytes`, docs/estimator.md, "Peak
timing"): with `set_requires_gradient_sync(False)` (the trainer's `_grad_sync` on every
micro-batch but the last) each rank keeps every parameter's whole gradient in the reduce dtype
(fp32), and only the last micro-batch leaves sharded gradients in the parameter dtype.

Two gloo processes on CPU, the trainer's mixed-precision policy (`modeling.shard_model`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")

pytestmark = pytest.mark.trainer

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def shapes(model):
        out = []
        for p in model.parameters():
            grad = p.grad
            out.append(None if grad is None else [list(grad.shape), str(grad.dtype)])
        return out

    def run(rank, world, store_path, out_path):
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
        ).to(torch.bfloat16)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        model.set_requires_gradient_sync(False)
        model(x).sum().backward()
        held = []
        for layer in model:
            for fsdp_param in layer._get_fsdp_state()._fsdp_param_group.fsdp_params:
                grad = fsdp_param._unsharded_param.grad
                held.append([list(grad.shape), str(grad.dtype)])
        between = {"held": held, "sharded": shapes(model)}
        model.set_requires_gradient_sync(True)
        model(x).sum().backward()
        last = [[list(p.grad.to_local().shape), str(p.grad.dtype)] for p in model.parameters()]
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"between": between, "last": last}, f)
        # both ranks past every collective before either tears gloo down: without it, a rank
        # that exits while its peer still closes the pair aborts ("terminate called without an
        # active exception", about one run in ten on two cores)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(run, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
    """
)


def test_fsdp2_holds_unsharded_fp32_gradients_between_micro_batches(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), str(out)],
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    # between micro-batches: the whole 64 x 64 gradient in fp32 on each of the 2 ranks,
    # no sharded gradient yet
    assert result["between"]["held"] == [[[64, 64], "torch.float32"]] * 2
    assert result["between"]["sharded"] == [None, None]
    # after the last micro-batch: this rank's half, in the parameters' bf16
    assert result["last"] == [[[32, 64], "torch.bfloat16"]] * 2
