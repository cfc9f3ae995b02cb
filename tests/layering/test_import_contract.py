"""The import-layering contract is real: it passes on the tree and fails when a service imports another.

The contract lives in pyproject.toml ([tool.importlinter]) and `make lint` runs it; here it is run on
a copy of the source tree with one forbidden import planted, to prove it would break the build.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = ["libs/shared", "services/controlplane", "services/capacity", "services/translator",
            "services/placement", "services/enforcer", "cli"]


def lint(root: Path) -> subprocess.CompletedProcess:
    paths = ":".join(str(root / p / "src") for p in PROJECTS)
    return subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--config", str(root / "pyproject.toml")],
        cwd=root, env={"PYTHONPATH": paths, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120,
    )


def copy_tree(dest: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for project in PROJECTS:
        shutil.copytree(ROOT / project / "src", dest / project / "src",
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))


def test_contract_holds_on_the_tree(tmp_path):
    copy_tree(tmp_path)
    result = lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_contract_breaks_when_a_service_imports_another(tmp_path):
    copy_tree(tmp_path)
    planted = tmp_path / "services/translator/src/tessera/translator/planted.py"
    planted.write_text("from tessera.placement import quota  # forbidden: services never import each other\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    assert "Services never import each other BROKEN" in result.stdout
    assert "tessera.translator.planted -> tessera.placement" in result.stdout
