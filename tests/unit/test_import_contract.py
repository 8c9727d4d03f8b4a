"""The import contracts in pyproject.toml (`lint-imports`, run by `make lint`) hold, and bite.

Each case copies the three import packages into a temporary tree, adds one import that breaks
one contract, and runs `lint-imports` on the copy: it must fail and name that contract. A
contract that a forbidden import does not break would be decoration.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "kubetune": ROOT / "operator/src/kubetune",
    "kubetune_trainer": ROOT / "trainer_image/src/kubetune_trainer",
    "kubetune_dev": ROOT / "operator/dev/src/kubetune_dev",
}
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(src: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for name, path in PACKAGES.items():
        shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def test_the_tree_keeps_every_contract(tree: Path) -> None:
    result = _lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


# One import per contract that must break it: (module, the line added, the contract's name).
BREAKS = [
    ("kubetune/planning/planner.py", "import kubetune_dev.cluster", "product-without-tooling"),
    ("kubetune/controller/kube.py", "from kubetune_dev import cli", "product-without-tooling"),
    ("kubetune/control/builders.py", "import kubetune_trainer.recipe", "trainer-contract-only"),
    ("kubetune/control/reconcile.py", "from kubetune import controller", "layers"),
    ("kubetune/api/v1alpha1.py", "from kubetune.planning import planner", "layers"),
    ("kubetune/sources.py", "import kubetune.cli", "layers"),
    ("kubetune/controller/run.py", "import kubetune.cli", "layers"),
    ("kubetune/planning/arch.py", "import urllib.request", "pure-core"),
    ("kubetune/control/progress.py", "import kopf", "pure-core"),
    ("kubetune_trainer/recipe/__init__.py", "import kopf", "trainer-knows-no-kubernetes"),
    ("kubetune_trainer/loss.py", "import kubetune_trainer.modeling", "trainer-acyclic"),
    (
        "kubetune_trainer/data.py",
        "from kubetune.api import v1alpha1",
        "trainer-knows-no-kubernetes",
    ),
    ("kubetune/planning/arch.py", "from kubetune.planning import estimator", "planning-layers"),
    ("kubetune/control/pods.py", "from kubetune.control import reconcile", "control-layers"),
    ("kubetune/controller/kube.py", "from kubetune.controller import handlers", "thin-handlers"),
    ("kubetune/controller/leader.py", "from kubetune.controller import kube", "thin-handlers"),
    ("kubetune/controller/handlers.py", "from kubetune.controller import run", "thin-handlers"),
    (
        "kubetune_dev/podrunner/podspec.py",
        "from kubetune_dev.podrunner import runner",
        "podrunner-layers",
    ),
]


def _contracts() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["id"]: c["name"] for c in config["tool"]["importlinter"]["contracts"]}


def test_every_contract_has_an_import_that_breaks_it() -> None:
    assert {contract for _, _, contract in BREAKS} == set(_contracts())


@pytest.mark.parametrize(("module", "line", "contract"), BREAKS)
def test_a_forbidden_import_breaks_its_contract(
    tree: Path, module: str, line: str, contract: str
) -> None:
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}  # added by the test\n")
    result = _lint_imports(tree)
    assert result.returncode != 0, f"adding `{line}` to {module} broke no contract"
    broken = result.stdout.split("Broken contracts", 1)[-1]
    # lint-imports wraps long names at 80 columns: look for the start of the name.
    assert _contracts()[contract].split(":")[0][:40] in broken, result.stdout


def test_operator_folder_is_not_a_package() -> None:
    """A package named `operator` would shadow the standard library's."""
    assert not (ROOT / "operator/__init__.py").exists()


def test_the_cpu_steps_after_training_do_not_load_torch() -> None:
    """The stage-out and export pods start their step without torch (about a second and a
    half of imports, and its memory, for nothing): only the stage-in measures data with it."""
    code = (
        "import sys, kubetune_trainer.stageout.__main__, kubetune_trainer.export; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
