"""docs/configuration.md lists every environment variable a service or the CLI reads."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "libs", ROOT / "services", ROOT / "cli"]
# How the code reads a variable: the settings helpers, env.get / os.environ.get, os.environ[...]
READ = re.compile(
    r"""(?:env_str|env_int|env_float|env_choice|env_bool|_positive|_port)\(\s*env,\s*"((?:TESSERA|OTEL)_[A-Z0-9_]+)"
      | (?:env|os\.environ)\.get\(\s*"((?:TESSERA|OTEL)_[A-Z0-9_]+)"
      | os\.environ\[\s*"((?:TESSERA|OTEL)_[A-Z0-9_]+)"\s*\](?!\s*=[^=])""",
    re.VERBOSE,
)


def variables_read() -> set[str]:
    found = set()
    for base in SOURCES:
        for path in base.rglob("*.py"):
            if "/tests/" in str(path) or "gpu-demo" in str(path):
                continue
            for match in READ.finditer(path.read_text()):
                found.add(next(g for g in match.groups() if g))
    return found


def test_every_variable_read_is_documented():
    documented = set(re.findall(r"`((?:TESSERA|OTEL)_[A-Z0-9_]+)`", (ROOT / "docs" / "configuration.md").read_text()))
    read = variables_read()
    assert len(read) > 40  # the scan itself still finds them
    missing = sorted(read - documented)
    assert not missing, f"read by the code but not in docs/configuration.md: {missing}"
    stale = sorted(documented - read)
    assert not stale, f"in docs/configuration.md but read by nothing: {stale}"


def test_every_variable_the_deployments_set_is_one_a_service_reads():
    set_in_deploy = set()
    for path in (ROOT / "deploy").rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".yml", ".env"):
            # (not stream names inside NATS subjects: $JS.API.STREAM.INFO.TESSERA_CLAIMS)
            set_in_deploy |= set(re.findall(r"(?<![.\w])((?:TESSERA|OTEL)_[A-Z0-9_]+)\b", path.read_text()))
    # TESSERA_COMPOSE_*: the compose file's own host-port knobs, read by compose itself (deploy/compose/README.md)
    set_in_deploy = {v for v in set_in_deploy if not v.startswith("TESSERA_COMPOSE_")}
    unknown = sorted(set_in_deploy - variables_read())
    assert not unknown, f"deploy/ sets variables no service reads: {unknown}"
