"""docs/configuration.md is generated from the settings' declarations and must be current."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

from tessera.shared.configdoc import Table, documented, render
from tessera.shared.settings import FromEnv, ServiceSettings

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
SERVICES = ("controlplane", "capacity", "translator", "placement", "enforcer")


def generator():
    spec = importlib.util.spec_from_file_location("configuration_page", ROOT / "docs" / "configuration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_configuration_matches_the_declarations():
    assert DOC.read_text() == render(generator().PAGE), "docs/configuration.md is out of date: run 'make docs'"


def test_the_generator_writes_the_page_and_says_when_a_copy_is_stale(tmp_path):
    def generate(*args):
        return subprocess.run([sys.executable, str(ROOT / "docs" / "configuration.py"), *args],
                              capture_output=True, text=True, timeout=120)

    page = tmp_path / "configuration.md"
    assert generate(str(page)).returncode == 0 and page.read_text() == DOC.read_text()
    assert generate("--check", str(page)).returncode == 0
    page.write_text(page.read_text().replace("| `TESSERA_NODE` | required |", "| `TESSERA_NODE` | `n1` |"))
    stale = generate("--check", str(page))
    assert stale.returncode == 1 and "is out of date: run 'make docs'" in stale.stderr


def test_every_services_settings_are_on_the_page():
    on_page = {part.settings for part in generator().PAGE if isinstance(part, Table)}
    declared = {ServiceSettings}
    for service in SERVICES:
        module = importlib.import_module(f"tessera.{service}.settings")
        declared |= {cls for _, cls in inspect.getmembers(module, inspect.isclass)
                     if issubclass(cls, FromEnv) and cls.__module__ == module.__name__}
    assert len(declared) == 6 and declared <= on_page, sorted(c.__name__ for c in declared - on_page)


def test_a_setting_left_out_of_the_page_is_refused():
    from tessera.placement.settings import PlacementSettings

    try:
        render([Table(PlacementSettings)])  # without its reconciler and Kubernetes groups
    except ValueError as exc:
        assert "TESSERA_PLACEMENT_RECONCILE_SECONDS" in str(exc)
    else:
        raise AssertionError("a page without the reconciler's settings was rendered")


def test_every_variable_the_deployments_set_is_one_a_service_reads():
    set_in_deploy = set()
    for path in (ROOT / "deploy").rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".yml", ".env"):
            # (not stream names inside NATS subjects: $JS.API.STREAM.INFO.TESSERA_CLAIMS)
            set_in_deploy |= set(re.findall(r"(?<![.\w])((?:TESSERA|OTEL)_[A-Z0-9_]+)\b", path.read_text()))
    # TESSERA_COMPOSE_*: the compose file's own host-port knobs, read by compose itself (deploy/compose/README.md)
    set_in_deploy = {v for v in set_in_deploy if not v.startswith("TESSERA_COMPOSE_")}
    declared = documented(generator().PAGE)
    assert len(declared) > 40
    unknown = sorted(set_in_deploy - declared)
    assert not unknown, f"deploy/ sets variables no service reads: {unknown}"
