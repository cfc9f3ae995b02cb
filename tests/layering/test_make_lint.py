"""`make lint` guards the house: it passes on the tree and fails on a planted violation of each rule.

Its three tools are configured in pyproject.toml: the import contracts (import-linter: services
independent, nats and kubernetes_asyncio only in the named adapters, placement's layers), ruff's
bug-finding rules and mypy on libs/shared and the services. Each test here copies the sources to a
temporary directory, plants one violation and runs the tool as the Makefile does, to prove the rule
would break the build; the first test checks that the Makefile runs exactly these commands.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROJECTS = ["libs/shared", "services/controlplane", "services/capacity", "services/translator",
            "services/placement", "services/enforcer", "cli"]

# The lint recipe's commands (Makefile), with the tool each one runs.
IMPORTS = "PYTHONPATH=$(SRC_PATHS) $(VENV)/bin/lint-imports"
RUFF = "$(VENV)/bin/ruff check --quiet ."
MYPY = "$(VENV)/bin/mypy"


def test_make_lint_runs_the_three_tools():
    recipe = re.search(r"^lint:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "the Makefile has no lint target"
    assert [line.strip() for line in recipe.group(1).splitlines()] == [IMPORTS, RUFF, MYPY]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    paths = ":".join(str(root / p / "src") for p in PROJECTS)
    return run([str(BIN / "lint-imports"), "--config", str(root / "pyproject.toml")], root, PYTHONPATH=paths)


def ruff(root: Path) -> subprocess.CompletedProcess:
    return run([str(BIN / "ruff"), "check", "--quiet", "--no-cache", "."], root)


def mypy(root: Path) -> subprocess.CompletedProcess:
    return run([str(BIN / "mypy")], root)


def run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=300)


def copy_tree(dest: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for project in PROJECTS:
        shutil.copytree(ROOT / project / "src", dest / project / "src",
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    return dest


def plant(root: Path, module: str, source: str) -> None:
    """Add `source` to `module` (tessera.<service>.<name>) in the copy, creating the module if new."""
    _, package, *rest = module.split(".")
    project = "libs/shared" if package == "shared" else f"services/{package}"
    path = root / project / "src" / "tessera" / package / Path(*rest).with_suffix(".py")
    path.write_text((path.read_text() if path.exists() else "") + source)


def test_the_tree_is_clean():
    for result in (lint_imports(ROOT), ruff(ROOT), mypy(ROOT)):
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_import_contracts_hold_on_a_copy(tmp_path):
    result = lint_imports(copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_service_importing_another_breaks_the_contract(tmp_path):
    root = copy_tree(tmp_path)
    plant(root, "tessera.translator.planted", "from tessera.placement import quota\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "Services never import each other BROKEN" in result.stdout
    assert "tessera.translator.planted -> tessera.placement" in result.stdout


def test_nats_imported_outside_the_named_adapters_breaks_the_contract(tmp_path):
    root = copy_tree(tmp_path)
    plant(root, "tessera.translator.planted", "import nats\n")
    plant(root, "tessera.shared.events", "\nimport kubernetes_asyncio\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "Only the named adapters talk to NATS or Kubernetes directly BROKEN" in result.stdout
    assert "tessera.translator.planted -> nats" in result.stdout
    assert "tessera.shared.events -> kubernetes_asyncio" in result.stdout


def test_placements_engine_importing_its_service_breaks_the_layers(tmp_path):
    root = copy_tree(tmp_path)
    plant(root, "tessera.placement.engine", "\nfrom tessera.placement import service\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "Placement's modules are layered BROKEN" in result.stdout
    assert "tessera.placement.engine -> tessera.placement.service" in result.stdout


def test_a_placement_module_without_a_layer_breaks_the_layers(tmp_path):
    root = copy_tree(tmp_path)
    plant(root, "tessera.placement.planted", "from tessera.placement import fleet\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "Placement's modules are layered BROKEN" in result.stdout
    assert "tessera.placement.planted" in result.stdout and "not listed as layers" in result.stdout


def test_ruff_fails_on_a_planted_finding(tmp_path):
    root = copy_tree(tmp_path)
    assert ruff(root).returncode == 0
    plant(root, "tessera.shared.planted",
          "def handlers(names):\n    return [lambda: name for name in names]\n")  # each closure sees the last name
    result = ruff(root)
    assert result.returncode != 0
    assert "B023" in result.stdout and "planted.py" in result.stdout


def test_mypy_fails_on_a_planted_type_error(tmp_path):
    root = copy_tree(tmp_path)
    assert mypy(root).returncode == 0
    plant(root, "tessera.shared.planted", "def replicas() -> int:\n    return '3'\n")
    result = mypy(root)
    assert result.returncode != 0
    assert "planted.py:2: error: Incompatible return value type" in result.stdout

