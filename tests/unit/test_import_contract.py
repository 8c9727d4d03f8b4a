"""The import contracts in pyproject.toml (`lint-imports`, run by `make lint`) hold, and bite.

The three import packages are copied into a temporary tree and every import of `BREAKS` is
added to it at once; one run of `lint-imports` on the copy must then report each contract
broken by its own added line (the importer and that line's number, in that contract's
section of the report). A contract that a forbidden import does not break would be
decoration. One run instead of one per case: each run reads the whole tree (seconds).
"""

from __future__ import annotations

import os
import re
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
    "kubetune_dev": ROOT / "dev/src/kubetune_dev",
}
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(src: Path) -> subprocess.CompletedProcess[str]:
    # Wide enough that no contract name or import chain is wrapped in the report.
    env = {**os.environ, "PYTHONPATH": str(src), "COLUMNS": "500"}
    return subprocess.run(
        [str(LINT_IMPORTS), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy_tree(root: Path) -> Path:
    src = root / "src"
    for name, path in PACKAGES.items():
        shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def test_the_tree_keeps_every_contract(tmp_path: Path) -> None:
    result = _lint_imports(_copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


# One import per contract that must break it: (module, the line added, the contract's name).
BREAKS = [
    (
        "kubetune/planning/planner/search.py",
        "import kubetune_dev.cluster",
        "product-without-tooling",
    ),
    ("kubetune/controller/kube.py", "from kubetune_dev import cli", "product-without-tooling"),
    ("kubetune/control/build/config.py", "import kubetune_trainer.recipe", "trainer-contract-only"),
    ("kubetune/control/reconcile/__init__.py", "from kubetune import controller", "layers"),
    ("kubetune/api/v1alpha1.py", "from kubetune.planning import planner", "layers"),
    ("kubetune/sources.py", "import kubetune.cli", "layers"),
    ("kubetune/controller/run.py", "import kubetune.cli", "layers"),
    ("kubetune_dev/cluster.py", "import kubetune.cli", "cli-from-entry-points-only"),
    ("kubetune/cli/views.py", "from kubetune.cli import follow", "cli-layers"),
    ("kubetune/cli/follow.py", "from kubetune.controller import kube", "cli-views-pure"),
    ("kubetune/planning/arch.py", "import urllib.request", "pure-core"),
    # The URI parser, which the pure core imports from the trainer's package, stays pure too.
    ("kubetune_trainer/uris.py", "import os", "pure-core"),
    ("kubetune/control/progress.py", "import kopf", "pure-core"),
    ("kubetune_trainer/recipe/__init__.py", "import kopf", "trainer-knows-no-kubernetes"),
    ("kubetune_trainer/loss.py", "import kubetune_trainer.modeling", "trainer-acyclic"),
    (
        "kubetune_trainer/data/records.py",
        "from kubetune.api import v1alpha1",
        "trainer-knows-no-kubernetes",
    ),
    ("kubetune/planning/arch.py", "from kubetune.planning import estimator", "planning-layers"),
    (
        "kubetune/control/pods.py",
        "from kubetune.control.reconcile.context import Observed",
        "control-layers",
    ),
    (
        "kubetune/control/reconcile/launch.py",
        "from kubetune.control.reconcile import recovery",
        "reconcile-layers",
    ),
    (
        "kubetune/control/build/names.py",
        "from kubetune.control.build import trainer",
        "build-layers",
    ),
    ("kubetune/controller/kube.py", "from kubetune.controller import handlers", "thin-handlers"),
    ("kubetune/controller/leader.py", "from kubetune.controller import kube", "thin-handlers"),
    ("kubetune/controller/handlers.py", "from kubetune.controller import run", "thin-handlers"),
    # Inside the reconcile loops: the rooms below never import the loops, nor the loops
    # each other.
    (
        "kubetune/controller/status_writes.py",
        "from kubetune.controller import carry_out",
        "thin-handlers",
    ),
    ("kubetune/controller/jobloop.py", "from kubetune.controller import poolloop", "thin-handlers"),
    (
        "kubetune/controller/settings/__init__.py",
        "from kubetune.controller import metrics",
        "thin-handlers",
    ),
    ("kubetune/controller/backoff.py", "from kubetune.controller import kube", "thin-handlers"),
    (
        "kubetune_dev/podrunner/podspec.py",
        "from kubetune_dev.podrunner import runner",
        "podrunner-layers",
    ),
    (
        "kubetune/planning/planner/plans.py",
        "from kubetune.planning.planner import context",
        "planner-layers",
    ),
]


def _contracts() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["id"]: c["name"] for c in config["tool"]["importlinter"]["contracts"]}


def test_every_contract_has_an_import_that_breaks_it() -> None:
    assert {contract for _, _, contract in BREAKS} == set(_contracts())


def _module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sections(report: str) -> dict[str, str]:
    """The broken contracts' sections of a report, by contract name (each name is a line
    underlined with dashes)."""
    lines = report.split("Broken contracts", 1)[-1].splitlines()
    heads = [
        i
        for i in range(len(lines) - 1)
        if lines[i].strip() and set(lines[i + 1]) == {"-"} and len(lines[i + 1]) == len(lines[i])
    ]
    return {
        lines[i]: "\n".join(lines[i + 2 : end])
        for i, end in zip(heads, [*heads[1:], len(lines)], strict=True)
    }


def _contract_types() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["id"]: c["type"] for c in config["tool"]["importlinter"]["contracts"]}


def _evidence(section: str, module: str, line: str, lineno: int, kind: str) -> str | None:
    """The line of a contract's section that shows the case's own import: a hop of a chain
    ("- a -> b (l.12)", or "  a -> b (l.12, l.40)" further down) from the module at the added
    line; for an acyclic contract, the dependency of the circle it made that the report
    names ("- .modeling -> .loss"), in either direction."""
    importer = _module_name(module)
    if kind == "acyclic_siblings":
        imported = line.split()[-1] if line.startswith("import ") else line.split()[1]
        pair = {importer.rsplit(".", 1)[-1], imported.rsplit(".", 1)[-1]}
        for text in section.splitlines():
            edge = re.match(r"- \.(\S+) -> \.(\S+) ", text)
            if edge and set(edge.groups()) == pair:
                return text
        return None
    own = re.compile(rf"{re.escape(importer)} -> \S+ \((l\.\d+, )*l\.{lineno}[,)]")
    hits = [t.lstrip("- ") for t in section.splitlines() if own.match(t.lstrip("- "))]
    return hits[0] if hits else None


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], str]:
    """Every case's import added to one copy of the tree; for each case, the line of its
    contract's section of the report that shows its own import, or why there is none."""
    tree = _copy_tree(tmp_path_factory.mktemp("contracts"))
    added: dict[tuple[str, str, str], int] = {}
    for module, line, contract in BREAKS:
        path = tree / module
        text = path.read_text()
        path.write_text(f"{text}\n{line}  # added by the test\n")
        added[(module, line, contract)] = len(text.splitlines()) + 2
    result = _lint_imports(tree)
    assert result.returncode != 0, "the added imports broke no contract"
    sections = _sections(result.stdout)
    kinds = _contract_types()
    found: dict[tuple[str, str, str], str] = {}
    for case, lineno in added.items():
        module, line, contract = case
        name = _contracts()[contract]
        section = sections.get(name)
        if section is None:
            found[case] = f"NOT BROKEN: {name!r}\n{result.stdout}"
            continue
        shown = _evidence(section, module, line, lineno, kinds[contract])
        found[case] = shown or f"NOT SHOWN: no line of {module}:{lineno}\n{section}"
    return found


@pytest.mark.parametrize(("module", "line", "contract"), BREAKS)
def test_a_forbidden_import_breaks_its_contract(
    broken: dict[tuple[str, str, str], str], module: str, line: str, contract: str
) -> None:
    shown = broken[(module, line, contract)]
    assert not shown.startswith("NOT "), shown


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
