"""The fused loss's equivalence cases (fused_loss_cases.py), run under Triton's interpreter.

Triton reads `TRITON_INTERPRET` when it defines a kernel, its own library's included, and
this pytest process imported triton long ago (torch's compiler and bitsandbytes do): the
cases run in a pytest process of their own, started with the variable set."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("liger_kernel", reason="the fused loss needs liger-kernel (trainer extra)")

pytestmark = pytest.mark.trainer

CASES = Path(__file__).with_name("fused_loss_cases.py")


def test_the_fused_loss_equals_the_plain_one_under_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = re.search(r"(\d+) passed", out)
    assert summary and int(summary.group(1)) == 8 and "skipped" not in out, out[-2000:]
