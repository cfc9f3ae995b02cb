"""The four PATCH flavours of the API server, applied to a stored object by the emulator.

JSON merge patch (RFC 7386) and JSON patch (RFC 6902, the pinned ``jsonpatch``) are exact.
Strategic merge patch and server-side apply are approximations, documented here because tests
rely on where they differ from kube-apiserver:

- Strategic merge: maps merge as in a merge patch; a list whose field name is in ``MERGE_KEYS``
  is merged element by element on that key (``containers`` by name, ``schedulingGates`` by name,
  ``conditions`` by type, ...), keyed by the field name wherever it appears rather than by the Go
  type's patch tags; ``$patch: delete`` / ``$patch: replace`` on an element or map and
  ``$deleteFromPrimitiveList/<field>`` are honoured; ``finalizers`` merge as a set; other lists are
  replaced; ``$setElementOrder`` and ``$retainKeys`` directives are dropped.
- Server-side apply: the applied configuration is merged in like a strategic merge (same list
  keys; ``atomic`` lists replaced) and the fields that the same field manager applied last time
  but no longer applies are removed. There is no per-field ownership across managers, so no
  apply conflict (409) is ever reported: every apply behaves as ``force=true``.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "env": "name", "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
    "schedulingGates": "name", "conditions": "type", "resourceClaims": "name", "claims": "name",
    "imagePullSecrets": "name", "ownerReferences": "uid", "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey", "readinessGates": "conditionType",
    "containerStatuses": "name", "initContainerStatuses": "name", "resourceClaimStatuses": "name",
}
# Containers' ports merge on containerPort, a Service's on port.
PORT_KEYS = ("containerPort", "port")
SET_LISTS = {"finalizers"}


class PatchError(ValueError):
    """The patch cannot be applied; ``status`` is the code the API server would answer."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def json_patch(target: dict, operations: Any) -> dict:
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations", status=400)
    try:
        return jsonpatch.apply_patch(target, operations)
    except jsonpatch.JsonPatchTestFailed as exc:
        raise PatchError(f"the server rejected our request due to an error in our request: {exc}") from None
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
        raise PatchError(f"the server rejected our request due to an error in our request: {exc}") from None
    except (TypeError, KeyError, IndexError) as exc:
        raise PatchError(f"malformed JSON patch: {exc}", status=400) from None


def _list_key(field: str, items: list) -> str | None:
    if field in MERGE_KEYS:
        return MERGE_KEYS[field]
    if field == "ports":
        for key in PORT_KEYS:
            if items and all(isinstance(i, dict) and key in i for i in items):
                return key
    return None


def strategic_merge(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            out[field] = [v for v in out.get(field) or [] if v not in value]
            continue
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list):
            out[key] = _merge_list(key, out.get(key), value)
        else:
            merged = strategic_merge(out.get(key), value)
            if merged is None:
                out.pop(key, None)
            else:
                out[key] = merged
    return out


def _merge_list(field: str, current: Any, patch: list) -> list:
    current = current if isinstance(current, list) else []
    if field in SET_LISTS:
        return list(current) + [v for v in patch if v not in current]
    key = _list_key(field, patch or current)
    if key is None or not all(isinstance(i, dict) for i in patch):
        return copy.deepcopy(patch)
    if any(i.get("$patch") == "replace" for i in patch):
        return [copy.deepcopy({k: v for k, v in i.items() if k != "$patch"}) for i in patch
                if i.get("$patch") != "replace"]
    out = [copy.deepcopy(i) for i in current]
    for item in patch:
        if key not in item:
            raise PatchError(f"map: {item} does not contain declared merge key: {key}", status=400)
        index = next((n for n, i in enumerate(out) if isinstance(i, dict) and i.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del out[index]
            continue
        if index is None:
            out.append(strategic_merge({}, item))
        else:
            out[index] = strategic_merge(out[index], item)
    return out


def _drop_unapplied(obj: Any, before: Any, now: Any) -> Any:
    """Remove from ``obj`` the map fields present in ``before`` (last apply) but not in ``now``."""
    if not (isinstance(obj, dict) and isinstance(before, dict)):
        return obj
    now = now if isinstance(now, dict) else {}
    for key, value in before.items():
        if key not in now:
            obj.pop(key, None)
        elif key in obj:
            obj[key] = _drop_unapplied(obj[key], value, now[key])
    return obj


def server_side_apply(current: dict, applied: dict, last_applied: dict | None) -> dict:
    out = copy.deepcopy(current)
    if last_applied is not None:
        out = _drop_unapplied(out, {k: v for k, v in last_applied.items() if k not in ("apiVersion", "kind")},
                              applied)
    return strategic_merge(out, applied)
