"""What a trainer process imports before its first step: every pod start pays for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.trainer

PROBE = """
import json, os, sys
from kubetune_trainer.bnb import import_bitsandbytes
bnb = import_bitsandbytes()
again = import_bitsandbytes()
import peft  # imports bitsandbytes itself where it is installed
import torch
param = torch.nn.Parameter(torch.ones(4, 4))
opt = bnb.optim.AdamW8bit([param], lr=0.1)
param.grad = torch.ones(4, 4)
opt.step()
print(json.dumps({
    "same": bnb is again,
    "inductor": "torch._inductor.compile_fx" in sys.modules,
    "dynamo_env": os.environ.get("TORCHDYNAMO_DISABLE"),
    "stepped": bool((param < 1).all()),
}))
"""


def probe(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_bitsandbytes_is_imported_without_torch_inductor_and_still_steps() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    got = probe(env)
    # Its CPU kernels' torch.compile wrappers would import TorchInductor (seconds per start).
    assert got == {"same": True, "inductor": False, "dynamo_env": None, "stepped": True}


def test_a_users_dynamo_setting_is_left_as_it_was() -> None:
    got = probe({**os.environ, "TORCHDYNAMO_DISABLE": "0"})
    assert got["dynamo_env"] == "0" and got["stepped"] is True
