"""Strict schema validation for the API-server emulator: what kube-apiserver would refuse, refused.

A real API server decodes every write into its Go type (unknown fields are errors with
``fieldValidation=Strict``) and validates it; an emulator that stores whatever it is sent lets a
misspelt ``status.allocation`` pass every test and fail on the first cluster. Built-in kinds are
checked against kubernetes-validate's strict OpenAPI-derived JSON schemas; custom resources against
the ``openAPIV3Schema`` of their installed CRD, made strict the way the structural-schema rules
read it (an object with ``properties`` and no ``x-kubernetes-preserve-unknown-fields`` or
``additionalProperties`` admits no other field). Each error names its field path as the real
server's messages do (``status.devices[0].foo``).
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import jsonschema
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

# resource.k8s.io/v1 is served from 1.34 on; the brief for the harness fixes 1.35.
SCHEMA_VERSION = "1.35.0"


class SchemaMissing(Exception):
    """No schema for a kind the emulator serves: a gap in the emulator, not in the object."""


def field_path(parts) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@functools.lru_cache(maxsize=2)
def _definitions(version: str) -> Resource:
    return Resource.from_contents(
        kv_utils.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version))


@functools.lru_cache(maxsize=128)
def builtin_validator(kind: str, api_version: str, version: str = SCHEMA_VERSION):
    """kubernetes-validate's strict schema of one kind, loaded once (it reloads them per call)."""
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = kv_utils.schema_contents(
            f"kubernetes-json-schema/v{version}-local-strict/{kind.lower()}-{group}.json", version)
    except FileNotFoundError:
        raise SchemaMissing(f"no Kubernetes {version} schema for {kind} ({api_version})") from None
    registry = _definitions(version) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


OBJECT_META = {"$ref": "/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}


def _strict_structural(schema: dict) -> dict:
    """The CRD's structural schema with unknown fields made errors, in JSON-schema terms."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: _strict_structural(sub) for name, sub in value.items()}
        elif key == "items" and isinstance(value, dict):
            out[key] = _strict_structural(value)
        elif key == "additionalProperties" and isinstance(value, dict):
            out[key] = _strict_structural(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [_strict_structural(s) for s in value]
        elif key == "not":
            out[key] = _strict_structural(value)
        elif key == "nullable" or key.startswith("x-kubernetes-") or key == "default":
            continue
        else:
            out[key] = value
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def custom_validator(openapi_schema: dict, version: str = SCHEMA_VERSION):
    """A validator for custom resources of one CRD version (metadata checked as ObjectMeta)."""
    schema = _strict_structural(copy.deepcopy(openapi_schema))
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"type": "string"}
    props["kind"] = {"type": "string"}
    props["metadata"] = OBJECT_META
    schema["additionalProperties"] = False
    schema["$id"] = "https://kubernetes.io/api/customresource"  # where the ObjectMeta reference resolves
    registry = _definitions(version) @ Registry()
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def apply_defaults(schema: dict, value: Any) -> Any:
    """Fill in ``default`` values of a structural schema, as the API server does on every write."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def errors(validator, obj: dict) -> list[tuple[str, str]]:
    """(field path, message) for each way ``obj`` breaks the schema; an unknown field is named."""
    out: list[tuple[str, str]] = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        out.extend(_explain(error))
    seen: set[tuple[str, str]] = set()
    return [e for e in out if not (e in seen or seen.add(e))]


def _explain(error: jsonschema.ValidationError) -> list[tuple[str, str]]:
    parts = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = set(error.schema.get("properties", {}))
        patterns = [re.compile(p) for p in error.schema.get("patternProperties", {})]
        extra = [k for k in error.instance if k not in known and not any(p.search(k) for p in patterns)]
        return [(field_path([*parts, k]), f'unknown field "{field_path([*parts, k])}"') for k in extra]
    if error.validator in ("anyOf", "oneOf") and error.context:
        # the narrowest explanation among the alternatives (e.g. int-or-string)
        best = jsonschema.exceptions.best_match(error.context)
        if best is not None and list(best.absolute_path) != parts:
            return _explain(best)
    if error.validator == "required":
        missing = re.match(r"'([^']+)' is a required property", error.message)
        if missing:
            return [(field_path([*parts, missing.group(1)]), "Required value")]
    return [(field_path(parts) or "<root>", f"Invalid value: {error.message}")]
