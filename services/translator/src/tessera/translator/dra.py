"""A ClaimSpec rendered as Kubernetes DRA documents (``resource.k8s.io/v1``).

On Kubernetes a translated claim has to become a DRA document: a ResourceClaim (or a
ResourceClaimTemplate a pod points at) that says in DRA's own terms what Tessera's placement (the one
allocator of these devices) will allocate and write into its status, so that kube-scheduler, the
kubelet and ``kubectl`` read it as any other claim. Its request asks the Tessera device class for a
number of GPUs and, through consumable capacity (KEP-5075), for a share of each one's
``memory`` and ``cores``. Type and UUID selectors become CEL expressions over the attributes that
the capacity publisher puts in its ResourceSlices. The opaque driver config carries the whole
translated claim, including what DRA cannot express (priority, scheduling policies, a memory
percentage): Tessera's placement, not the scheduler, allocates these claims, and the translator
recovers the claim from a ResourceClaim's (immutable) spec with ``spec_from_parameters``.

The contract with the capacity publisher's ResourceSlices (driver ``gpu.tessera.dev``):
attributes ``model`` (string) and ``uuid`` (string); capacity ``memory`` (a quantity in bytes,
e.g. ``81559Mi``) and ``cores`` (``100``), with ``allowMultipleAllocations: true``; and no
``requestPolicy.default`` for ``memory`` smaller than the card, so that a request without a memory
entry consumes the whole card, as HAMi's "no gpumem" does. (The slices also carry ``shares``, the
GPU's share limit, which every allocation consumes one of by default: claims need not mention it.
They are written by ``tessera.capacity.slices``.)

Pure functions returning plain dicts: no Kubernetes client here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import msgspec

from tessera.shared.events import ClaimSpec, RequestSpec, request_specs
from tessera.shared.kubeclaims import DEVICE_CLASS, DRIVER, REQUEST_NAME
from tessera.shared.kubeclaims import RESOURCE_API_VERSION as API_VERSION

PARAMETERS_API_VERSION = "gpu.tessera.dev/v1alpha1"
PARAMETERS_KIND = "GpuClaimParameters"
MAX_SUBREQUESTS = 8  # DeviceRequest.firstAvailable limit

_ATTR = f"device.attributes[{json.dumps(DRIVER)}]"


def _cel_list(values: list[str]) -> str:
    # JSON string literals are valid CEL string literals (same escapes, \\uXXXX included).
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def cel_selectors(spec: ClaimSpec) -> list[dict]:
    """The DeviceSelectors for the spec's GPU type and UUID include/exclude lists.

    Types keep HAMi's meaning: a case-insensitive substring of the model name.
    """
    exprs: list[str] = []
    if spec.use_types:
        needles = _cel_list([t.upper() for t in spec.use_types])
        exprs.append(f"{needles}.exists(t, {_ATTR}.model.upperAscii().contains(t))")
    if spec.nouse_types:
        needles = _cel_list([t.upper() for t in spec.nouse_types])
        exprs.append(f"!{needles}.exists(t, {_ATTR}.model.upperAscii().contains(t))")
    if spec.use_uuids:
        exprs.append(f"{_ATTR}.uuid in {_cel_list(spec.use_uuids)}")
    if spec.nouse_uuids:
        exprs.append(f"!({_ATTR}.uuid in {_cel_list(spec.nouse_uuids)})")
    return [{"cel": {"expression": e}} for e in exprs]


def _capacity(memory_mib: int | None, cores: int) -> dict:
    requests: dict[str, str] = {}
    if memory_mib is not None:
        requests["memory"] = f"{memory_mib}Mi"
    # Always explicit: an absent entry would consume the whole card's cores.
    requests["cores"] = str(cores)
    return {"requests": requests}


def _model_matches(spec: ClaimSpec, model: str) -> bool:
    upper = model.upper()
    if spec.use_types and not any(t.upper() in upper for t in spec.use_types):
        return False
    return not any(t.upper() in upper for t in spec.nouse_types)


def _subrequest_name(model: str, taken: set[str]) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[:56] or "gpu"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    taken.add(name)
    return name


def device_request(
    spec: ClaimSpec,
    *,
    name: str = REQUEST_NAME,
    card_memory_mib: Mapping[str, int] | None = None,
) -> dict:
    """One ``DeviceRequest`` for the spec.

    A memory percentage has no quantity until the card is known. Given ``card_memory_mib``
    (model -> MiB, from the inventory), it becomes a ``firstAvailable`` list with one subrequest per
    eligible model, each asking for ``floor(card * percent / 100)`` MiB, which is how HAMi sizes it
    on the chosen card. Without it, memory is left out (the whole card, exact for 100 %) and the
    percentage rides in the opaque config for the node side to apply.
    """
    selectors = cel_selectors(spec)
    if spec.memory_percent is not None and card_memory_mib:
        subrequests: list[dict] = []
        taken: set[str] = set()
        for model, total in sorted(card_memory_mib.items()):
            if not _model_matches(spec, model):
                continue
            subrequests.append(
                {
                    "name": _subrequest_name(model, taken),
                    "deviceClassName": DEVICE_CLASS,
                    "selectors": [
                        *selectors,
                        {"cel": {"expression": f"{_ATTR}.model == {json.dumps(model)}"}},
                    ],
                    "allocationMode": "ExactCount",
                    "count": spec.gpus,
                    "capacity": _capacity(total * spec.memory_percent // 100, spec.cores),
                }
            )
        if not subrequests:
            raise ValueError("no GPU model in card_memory_mib passes the claim's type selectors")
        if len(subrequests) > MAX_SUBREQUESTS:
            raise ValueError(
                f"{len(subrequests)} GPU models would need {len(subrequests)} subrequests; "
                f"DRA allows at most {MAX_SUBREQUESTS}: narrow the type selectors"
            )
        return {"name": name, "firstAvailable": subrequests}
    exactly: dict = {
        "deviceClassName": DEVICE_CLASS,
        "allocationMode": "ExactCount",
        "count": spec.gpus,
        "capacity": _capacity(spec.memory_mib, spec.cores),
    }
    if selectors:
        exactly["selectors"] = selectors
    return {"name": name, "exactly": exactly}


# ClaimSpec field -> its key in the opaque parameters. The parameters carry the whole translated
# claim, so that the translator can recover it from the ResourceClaim (whose spec is immutable; its
# annotations are not) and placement allocates exactly what the webhook validated.
_PARAMETER_KEYS = {
    "gpus": "gpus",
    "memory_mib": "memoryMiB",
    "memory_percent": "memoryPercent",
    "cores": "cores",
    "use_types": "useTypes",
    "nouse_types": "nouseTypes",
    "use_uuids": "useUUIDs",
    "nouse_uuids": "nouseUUIDs",
    "node_policy": "nodePolicy",
    "gpu_policy": "gpuPolicy",
    "priority": "priority",
    "may_preempt": "mayPreempt",
    "task_priority": "taskPriority",
    "cpu_millis": "cpuMillis",
    "host_memory_mib": "hostMemoryMiB",
    "node": "node",
}
_ALWAYS = ("gpus", "cores", "priority")


_REQUEST_KEYS = {"name": "name", **{f: k for f, k in _PARAMETER_KEYS.items() if f in RequestSpec.__struct_fields__}}


def _encode(obj: ClaimSpec | RequestSpec, keys: dict[str, str]) -> dict:
    params: dict = {}
    for field, key in keys.items():
        value = getattr(obj, field)
        if field == "may_preempt":  # written only where it is not the default (True)
            if not value:
                params[key] = False
        elif (field in _ALWAYS or field == "name" or value not in (None, [], 0)
              or (field == "task_priority" and value == 0)):
            params[key] = list(value) if isinstance(value, list) else value
    return params


def parameters(spec: ClaimSpec) -> dict:
    """The opaque config payload: the whole claim, including what DRA's allocator cannot express
    (and, for a claim of several requests, each request's part under ``requests``)."""
    params: dict = {"apiVersion": PARAMETERS_API_VERSION, "kind": PARAMETERS_KIND, **_encode(spec, _PARAMETER_KEYS)}
    if spec.requests:
        params["requests"] = [_encode(r, _REQUEST_KEYS) for r in spec.requests]
    return params


def _renamed(message: str, keys: dict[str, str], prefix: str) -> str:
    for field, key in keys.items():
        message = message.replace(f"$.{field}", f"{prefix}{key}")
    return message


def _decode(values: dict, keys: dict[str, str], target: type, where: str):
    fields = {v: k for k, v in keys.items()}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; known: {sorted(fields)}")
    try:
        return msgspec.convert({fields[k]: v for k, v in values.items()}, target)
    except msgspec.ValidationError as exc:
        # msgspec names the field; say the parameter key the claim actually carries.
        raise ValueError(f"opaque parameters are invalid: {_renamed(str(exc), keys, where + '.')}") from None


def spec_from_parameters(params: object) -> ClaimSpec:
    """The ClaimSpec a ``parameters`` payload encodes; ValueError naming the key that is wrong."""
    if not isinstance(params, dict):
        raise ValueError("opaque parameters must be an object")
    if (params.get("apiVersion"), params.get("kind")) != (PARAMETERS_API_VERSION, PARAMETERS_KIND):
        raise ValueError(
            f"opaque parameters must be apiVersion {PARAMETERS_API_VERSION} kind {PARAMETERS_KIND}, got "
            f"{params.get('apiVersion')!r} / {params.get('kind')!r}"
        )
    values = {k: v for k, v in params.items() if k not in ("apiVersion", "kind", "requests")}
    requests = params.get("requests", [])
    if not isinstance(requests, list) or not all(isinstance(r, dict) for r in requests):
        raise ValueError("opaque parameters are invalid: parameters.requests must be a list of objects")
    parts = [_decode(r, _REQUEST_KEYS, RequestSpec, f"parameters.requests[{i}]") for i, r in enumerate(requests)]
    spec = _decode(values, _PARAMETER_KEYS, ClaimSpec, "parameters")
    spec = msgspec.structs.replace(spec, requests=parts)
    try:
        request_specs(spec)
    except ValueError as exc:
        raise ValueError(f"opaque parameters are invalid: {exc}") from None
    return spec


def request_names(spec: ClaimSpec) -> list[str]:
    """The DRA request names of the claim's requests, in order (``gpu`` for a claim of one)."""
    return [name or REQUEST_NAME for name, _ in request_specs(spec)]


def claim_spec(spec: ClaimSpec, *, card_memory_mib: Mapping[str, int] | None = None) -> dict:
    """A ``ResourceClaimSpec`` for the spec: one DeviceRequest per request of the claim."""
    parts = [(name or REQUEST_NAME, part) for name, part in request_specs(spec)]
    devices: dict = {
        "requests": [device_request(part, name=name, card_memory_mib=card_memory_mib) for name, part in parts],
        "config": [
            {
                "requests": [name for name, _ in parts],
                "opaque": {"driver": DRIVER, "parameters": parameters(spec)},
            }
        ],
    }
    # A GPU that allows multiple allocations could otherwise be picked twice for one request; HAMi's
    # gpu: 2 always means two physical GPUs. (Two requests may share a GPU, as two containers may.)
    constraints = [{"requests": [name], "distinctAttribute": f"{DRIVER}/uuid"} for name, part in parts if part.gpus > 1]
    if constraints:
        devices["constraints"] = constraints
    return {"devices": devices}


def _metadata(name: str, namespace: str | None, labels, annotations) -> dict:
    meta: dict = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    if labels:
        meta["labels"] = dict(labels)
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def resource_claim(
    spec: ClaimSpec,
    name: str,
    namespace: str | None = None,
    *,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    card_memory_mib: Mapping[str, int] | None = None,
) -> dict:
    """A ``ResourceClaim`` document."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaim",
        "metadata": _metadata(name, namespace, labels, annotations),
        "spec": claim_spec(spec, card_memory_mib=card_memory_mib),
    }


def resource_claim_template(
    spec: ClaimSpec,
    name: str,
    namespace: str | None = None,
    *,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    card_memory_mib: Mapping[str, int] | None = None,
) -> dict:
    """A ``ResourceClaimTemplate`` document; claims made from it carry the same labels."""
    inner: dict = {"spec": claim_spec(spec, card_memory_mib=card_memory_mib)}
    if labels:
        inner["metadata"] = {"labels": dict(labels)}
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": _metadata(name, namespace, labels, annotations),
        "spec": inner,
    }
