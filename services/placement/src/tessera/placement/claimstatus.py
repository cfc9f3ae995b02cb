"""A ledger allocation as the ``status.allocation`` of its ResourceClaim (``resource.k8s.io/v1``).

On Kubernetes placement is the one allocator of ``gpu.tessera.dev`` devices: kube-scheduler binds a
pod only once each of its claims shows an allocation, and the kubelet hands that allocation to the
node plugin. What placement decided in the ledger therefore has to be written in the exact shape the
scheduler and the kubelet read: one ``devices.results[]`` entry per GPU share, naming the request
(``gpu``, or for a pod's claim of several requests the container's request the share answers),
the driver, the node's pool and the device as the capacity publisher names them, with a ``shareID``
(the devices allow multiple allocations, and the API requires a share id for those) and the capacity
consumed; and a ``nodeSelector`` pinning the claim to the node, as the scheduler's own allocator
writes for node-local devices.

The share id is derived from the claim and the device, so a retried or repeated write (another
replica, a restart) produces the same document and "already written" can be recognised by equality.

Pure: plain dicts in and out; the writer is `tessera.placement.kube`.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone

from tessera.shared import quantity
from tessera.shared.events import DeviceShare
from tessera.shared.kubeclaims import DRIVER, REQUEST_NAME, device_name, pool_name

# Fixed namespace of the share ids: uuid5(namespace, "<claim>/<pool>/<device>").
SHARE_NAMESPACE = uuid.UUID("5b0f3c44-7f64-4f3e-9c3b-6a1d2e8f9a10")
_MODEL_SELECTOR = f'device.attributes["{DRIVER}"].model == '


def share_id(claim: str, node: str, index: int, request: str = "") -> str:
    """The ``shareID`` of a claim's share of one device: the same for every write of that claim.
    Two requests of one claim may share a device, so a named request is part of it (a claim of one
    request keeps the id it always had)."""
    which = f"{claim}/{request}" if request else claim
    return str(uuid.uuid5(SHARE_NAMESPACE, f"{which}/{pool_name(node)}/{device_name(index)}"))


def request_name(claim_spec: dict | None, model: str, request: str = REQUEST_NAME) -> str:
    """The request a result answers: ``request`` (``gpu`` for a claim of one), or
    ``<request>/<subrequest>`` where the claim asks with a ``firstAvailable`` list (a memory
    percentage: one subrequest per GPU model), the subrequest being the one that selects the
    allocated device's model."""
    requests = ((claim_spec or {}).get("devices") or {}).get("requests") or []
    for entry in requests:
        if entry.get("name") != request or not entry.get("firstAvailable"):
            continue
        # The translator writes the model as a JSON string literal (which is a valid CEL literal).
        wanted = _MODEL_SELECTOR + json.dumps(model)
        for sub in entry["firstAvailable"]:
            expressions = [(s.get("cel") or {}).get("expression", "") for s in sub.get("selectors") or []]
            if wanted in expressions:
                return f"{request}/{sub['name']}"
        raise ValueError(f"no subrequest of request {request!r} selects GPU model {model!r}")
    return request


def node_selector(node: str) -> dict:
    """A NodeSelector matching exactly ``node`` (by its name, as the DRA allocator writes it)."""
    return {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}


def allocation(claim: str, node: str, shares: list[DeviceShare], *, claim_spec: dict | None = None,
               models: dict[int, str] | None = None, at: datetime | None = None) -> dict:
    """The ``AllocationResult`` for ``shares`` of ``node`` given to ``claim``.

    ``claim_spec`` is the ResourceClaim's ``spec`` (to name the subrequest a percentage claim was
    allocated through) and ``models`` the node's GPU models by index (which subrequest that is).
    """
    results = []
    # (a claim of several requests keeps its requests' order: `sorted` is stable)
    for share in sorted(shares, key=lambda s: s.index if not s.request else 0):
        results.append({
            "request": request_name(claim_spec, (models or {}).get(share.index, ""), share.request or REQUEST_NAME),
            "driver": DRIVER,
            "pool": pool_name(node),
            "device": device_name(share.index),
            "shareID": share_id(claim, node, share.index, share.request),
            "consumedCapacity": {
                "memory": f"{share.memory_mib}Mi",
                "cores": str(share.cores),
                "shares": "1",
            },
        })
    stamp = (at or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return {
        "devices": {"results": results},
        "nodeSelector": node_selector(node),
        "allocationTimestamp": stamp.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


_RESULT_KEYS = ("request", "driver", "pool", "device", "shareID")


def _consumed(result: dict) -> tuple:
    """A result's consumed capacity by value: the API server canonicalizes the quantities placement
    wrote (``20480Mi`` is read back as ``20Gi``), so the text is not what was allocated."""
    consumed = result.get("consumedCapacity") or {}
    values = []
    for name, text in sorted(consumed.items()):
        try:
            values.append((name, str(quantity.parse(text).normalize())))
        except quantity.QuantityError:
            values.append((name, f"text:{text}"))
    return tuple(values)


def _essence(allocation: dict) -> tuple:
    results = ((allocation.get("devices") or {}).get("results")) or []
    return (sorted((tuple((k, json.dumps(r.get(k), sort_keys=True)) for k in _RESULT_KEYS), _consumed(r))
                   for r in results),
            json.dumps(allocation.get("nodeSelector"), sort_keys=True))


def same_allocation(written: dict | None, wanted: dict) -> bool:
    """Whether a claim's allocation already says what ``wanted`` says: the same devices, shares,
    capacities (by value) and node (the timestamp, and fields the API server adds, aside)."""
    return written is not None and bool(written) and _essence(written) == _essence(wanted)

