"""Running the helm binary of the control-plane build."""

from __future__ import annotations

import subprocess
from pathlib import Path


class Helm:
    """`helm` with fixed leading arguments (say, a kubeconfig); failures raise with its output."""

    def __init__(self, binary: Path, *flags: str, timeout: float = 180) -> None:
        self.argv = [str(binary), *flags]
        self.timeout = timeout

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [*self.argv, *args], capture_output=True, text=True, timeout=self.timeout, check=False
        )
        if check and out.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}:\n{out.stdout}\n{out.stderr}")
        return out
