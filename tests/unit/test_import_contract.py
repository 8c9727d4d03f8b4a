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


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        (
            "kubetune/planning/planner.py",
            "import kubetune_dev.cluster",
            "The product never imports the local tooling",
        ),
        (
            "kubetune/controller/kube.py",
            "from kubetune_dev import podrunner",
            "The product never imports the local tooling",
        ),
        (
            "kubetune/control/builders.py",
            "import kubetune_trainer.recipe",
            "The operator imports nothing of the trainer but its contract",
        ),
        (
            "kubetune/control/reconcile.py",
            "from kubetune import controller",
            "Layers:",
        ),
        (
            "kubetune/api/v1alpha1.py",
            "from kubetune.planning import planner",
            "Layers:",
        ),
        (
            "kubetune/planning/arch.py",
            "import urllib.request",
            "The pure core",
        ),
        (
            "kubetune_trainer/recipe.py",
            "import kopf",
            "The trainer knows neither the operator nor Kubernetes",
        ),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tree: Path, module: str, line: str, contract: str
) -> None:
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}  # added by the test\n")
    result = _lint_imports(tree)
    assert result.returncode != 0, f"adding `{line}` to {module} broke no contract"
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, result.stdout


def test_operator_folder_is_not_a_package() -> None:
    """A package named `operator` would shadow the standard library's."""
    assert not (ROOT / "operator/__init__.py").exists()
