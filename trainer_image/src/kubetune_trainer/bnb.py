"""bitsandbytes, imported the trainer's way.

Its own module, below both `modeling` (4-bit loading, PEFT) and `loss` (liger-kernel imports
peft, which imports bitsandbytes): neither needs the other to reach it.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def import_bitsandbytes() -> Any:
    """bitsandbytes, imported without compiling its CPU fallback kernels.

    Its import wraps those kernels in `torch.compile`, and that imports TorchInductor: about
    2.5 s of every trainer process's start on this project's 2-core test machine (4.2 s → 1.8 s
    for the import). With TorchDynamo off while it imports, the wrappers are plain functions and
    the kernels run eagerly; on a GPU bitsandbytes runs its CUDA kernels, not these. Call it
    before anything that imports bitsandbytes (peft does, transformers' 4-bit loader does)."""
    if "bitsandbytes" not in sys.modules:
        saved = os.environ.get("TORCHDYNAMO_DISABLE")
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        try:
            importlib.import_module("bitsandbytes")
        finally:
            if saved is None:
                del os.environ["TORCHDYNAMO_DISABLE"]
            else:
                os.environ["TORCHDYNAMO_DISABLE"] = saved
    return sys.modules["bitsandbytes"]
