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

The other way round, `held_shares` reads an allocation (any allocator's) as the node and GPU shares
it holds, so that one Tessera did not write can be adopted into the ledger (`tessera.placement.adoption`).

Pure: plain dicts in and out; the writer is `tessera.placement.kube`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import datetime, timezone

from tessera.shared import quantity
from tessera.shared.events import DeviceShare, GpuDevice
from tessera.shared.kubeclaims import DRIVER, REQUEST_NAME, device_index, device_name, pool_name

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


def _pinned(node_selector: dict | None) -> set[str]:
    """The node names a NodeSelector pins by name (empty: none by name)."""
    names: set[str] = set()
    for term in (node_selector or {}).get("nodeSelectorTerms") or []:
        for req in (term.get("matchFields") or []) + (term.get("matchExpressions") or []):
            if req.get("key") in ("metadata.name", "kubernetes.io/hostname") and req.get("operator") == "In":
                names.update(req.get("values") or [])
    return names


def describes(found: dict | None, node: str, shares: list[DeviceShare]) -> bool:
    """Whether allocation ``found`` (any allocator's: share ids aside) holds exactly ``shares`` of
    ``node``, by value; read without the node's inventory (which may not be loaded or known). Two
    requests of one claim may share a GPU, so results and shares are compared as multisets."""
    results = ((found or {}).get("devices") or {}).get("results") or []
    if not results or any(r.get("driver") != DRIVER or r.get("pool") != pool_name(node) for r in results):
        return False
    held = []
    for result in results:
        consumed = result.get("consumedCapacity") or {}
        try:
            index = device_index(str(result.get("device")))
            cores = quantity.parse(consumed.get("cores", ""))
        except (ValueError, quantity.QuantityError):
            return False
        held.append((index, quantity.whole_mib(consumed.get("memory", "")) or -1, cores))
    wanted = [(s.index, s.memory_mib, quantity.parse(s.cores)) for s in shares]
    return sorted(held) == sorted(wanted)


def held_shares(found: dict, devices_of: Callable[[str], list[GpuDevice] | None]) -> tuple[str, list[DeviceShare]]:
    """(node, shares): what allocation ``found`` holds, read as the ledger counts it. A result
    without ``consumedCapacity`` holds its whole GPU. ``devices_of(node)`` is the node's inventory
    (None: not in the fleet). ValueError, saying what, where the allocation is not one of whole
    ``gpu.tessera.dev`` devices of one node of the fleet."""
    results = ((found.get("devices") or {}).get("results")) or []
    others = sorted({str(r.get("driver")) for r in results if r.get("driver") != DRIVER})
    if others:
        raise ValueError(f"it allocates devices of another driver ({', '.join(others)})")
    pools = sorted({str(r.get("pool")) for r in results})
    if len(pools) != 1:
        raise ValueError("it allocates no device" if not pools else f"it spans several nodes ({', '.join(pools)})")
    node = pools[0]  # (one pool per node, named after it: kubeclaims.pool_name)
    pinned = _pinned(found.get("nodeSelector"))
    if pinned and pinned != {node}:
        raise ValueError(f"its node selector names {', '.join(sorted(pinned))}, its devices are on {node}")
    devices = devices_of(node)
    if devices is None:
        raise ValueError(f"node {node} is not in Tessera's fleet")
    by_index = {d.index: d for d in devices}
    shares = []
    for result in results:
        index = device_index(str(result.get("device")))  # (ValueError: not a Tessera device name)
        device = by_index.get(index)
        if device is None:
            raise ValueError(f"node {node} has no GPU {result.get('device')}")
        consumed = result.get("consumedCapacity")
        if not consumed:
            shares.append(DeviceShare(uuid=device.uuid, index=index, memory_mib=device.memory_mib, cores=100))
            continue
        memory = quantity.whole_mib(consumed.get("memory", f"{device.memory_mib}Mi"))
        try:
            cores = quantity.parse(consumed.get("cores", "100"))
        except quantity.QuantityError:
            cores = None
        if memory is None or cores is None or cores != int(cores) or not 0 < cores <= 100:
            raise ValueError(f"gpu-{index} consumes {consumed}, not whole MiB of memory and 1-100 cores")
        shares.append(DeviceShare(uuid=device.uuid, index=index, memory_mib=memory, cores=int(cores)))
    return node, sorted(shares, key=lambda s: s.index)
