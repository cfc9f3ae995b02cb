"""Validation of CDI spec files against the JSON schema in schema/, written from the CDI specification.

Every spec a test makes the enforcer write goes through `validate` (or `validate_dir`), so a field the
specification does not know, a bad name, or a feature newer than the declared ``cdiVersion`` fails the
test with the schema's path to the offending value.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Mapping

import jsonschema

SCHEMA = Path(__file__).parent / "schema" / "cdi-spec.schema.json"


@cache
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def errors(spec: Mapping[str, Any]) -> list[str]:
    """Every schema violation, each as '<json path>: <message>'."""
    return sorted(f"{e.json_path}: {e.message}" for e in validator().iter_errors(spec))


def validate(spec: Mapping[str, Any]) -> None:
    found = errors(spec)
    assert not found, "CDI spec does not conform to the specification:\n" + "\n".join(found)


def validate_dir(cdi_dir: Path) -> list[dict]:
    """Validate every spec file in a CDI directory; returns the specs (at least one expected)."""
    specs = []
    for path in sorted(cdi_dir.glob("*.json")):
        spec = json.loads(path.read_text())
        validate(spec)
        specs.append(spec)
    return specs
