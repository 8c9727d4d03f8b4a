"""The repository's scripts (hack/, and benchmarks/ run by path) imported as modules, for
tests of their pure parts: they are files run by path, not packages on `sys.path`. (The
benchmarks that share `benchmarks.measure` are modules of the `benchmarks` package, which
the tests import as such.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(relative: str) -> ModuleType:
    """Import `REPO/relative` (say `hack/values_table.py`) as a module named after
    its file, registered in `sys.modules` first: dataclasses look their module up there."""
    path = REPO / relative
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
