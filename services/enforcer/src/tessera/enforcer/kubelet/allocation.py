"""Whether a ResourceClaim's allocation is one this node may prepare, and with which GPU shares.

The kubelet asks for a claim by namespace, name and uid; what the API server says was allocated,
and what the ledger (the single source of truth) holds for that claim on this node, must agree
before anything is made on disk. Every disagreement is a per-claim error that says which fact is
wrong: another uid (the claim was deleted and made again), not allocated, another driver's
devices, another node's pool or node selector, no ledger entry here, or other GPUs or amounts than
the ledger's. Pure: the ResourceClaim as JSON and the ledger entry in, devices or an error out.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.shared import quantity
from tessera.shared.events import DeviceShare, LedgerEntry
from tessera.shared.kubeclaims import DRIVER, REQUEST_NAME, claim_id, device_index, pool_name

# A node selector names its node by field (metadata.name) or by the well-known hostname label.
_NODE_KEYS = ("metadata.name", "kubernetes.io/hostname")


class AllocationMismatch(ValueError):
    """The claim cannot be prepared here; the message says why."""


@dataclass(frozen=True)
class AllocatedDevice:
    """One device of the claim's allocation, with the ledger's share of that GPU."""

    request: str  # the request it answers, without a subrequest (what a container's claim names)
    pool: str
    device: str
    share_id: str | None
    share: DeviceShare


def selected_nodes(node_selector: dict | None) -> set[str]:
    """The node names a v1 NodeSelector pins (empty: it names none by name)."""
    names: set[str] = set()
    for term in (node_selector or {}).get("nodeSelectorTerms") or []:
        for req in (term.get("matchFields") or []) + (term.get("matchExpressions") or []):
            if req.get("key") in _NODE_KEYS and req.get("operator") == "In":
                names.update(req.get("values") or [])
    return names


def check(obj: dict, *, uid: str, node: str, entry: LedgerEntry | None) -> list[AllocatedDevice]:
    """The devices of ResourceClaim ``obj`` to prepare on ``node``; AllocationMismatch if none may be."""
    meta = obj.get("metadata") or {}
    ref = f"ResourceClaim {meta.get('namespace')}/{meta.get('name')}"
    if meta.get("uid") != uid:
        raise AllocationMismatch(f"{ref} has uid {meta.get('uid')}, not {uid} as the kubelet asked "
                                 "(deleted and created again?): the kubelet will ask for the new one")
    allocation = (obj.get("status") or {}).get("allocation")
    if not allocation:
        raise AllocationMismatch(f"{ref} is not allocated")
    results = (allocation.get("devices") or {}).get("results") or []
    ours = [r for r in results if r.get("driver") == DRIVER]
    if not ours:
        others = sorted({str(r.get("driver")) for r in results}) or ["none"]
        raise AllocationMismatch(f"{ref} has no device of driver {DRIVER} (allocated: {', '.join(others)})")
    pinned = selected_nodes(allocation.get("nodeSelector"))
    if pinned and node not in pinned:
        raise AllocationMismatch(f"{ref} is allocated for node {', '.join(sorted(pinned))}, not for this node {node}")
    for result in ours:
        if result.get("pool") != pool_name(node):
            raise AllocationMismatch(f"{ref}: device {result.get('device')} is in pool {result.get('pool')} "
                                     f"(node {result.get('pool')}), not on this node {node}")
    claim = claim_id(uid)
    if entry is None:
        raise AllocationMismatch(f"{ref} (claim {claim}) has no entry in the ledger of node {node}: "
                                 "placement did not allocate it here, or it was released")
    # A share is known by its request and GPU: two requests of a claim (two containers) may share a GPU.
    shares = {(s.request or REQUEST_NAME, s.index): s for s in entry.shares}
    try:
        keys = [(base_request(str(r.get("request", ""))), device_index(str(r.get("device")))) for r in ours]
    except ValueError as exc:
        raise AllocationMismatch(f"{ref}: {exc}") from None
    if sorted(keys) != sorted(shares):
        wanted = ", ".join(_label(k) for k in sorted(keys))
        held = ", ".join(_label(k) for k in sorted(shares)) or "nothing"
        raise AllocationMismatch(f"{ref} is allocated {wanted} but the ledger of node {node} holds {held} "
                                 f"for claim {claim}")
    devices = []
    for result, key in zip(ours, keys):
        share = shares[key]
        index = key[1]
        consumed = result.get("consumedCapacity") or {}
        if "memory" in consumed and quantity.whole_mib(consumed["memory"]) != share.memory_mib:
            raise AllocationMismatch(f"{ref}: gpu-{index} consumes memory {consumed['memory']} but the ledger "
                                     f"of node {node} holds {share.memory_mib}Mi for claim {claim}")
        if "cores" in consumed and not quantity.equal(consumed["cores"], share.cores):
            raise AllocationMismatch(f"{ref}: gpu-{index} consumes cores {consumed['cores']} but the ledger "
                                     f"of node {node} holds {share.cores} for claim {claim}")
        devices.append(AllocatedDevice(request=key[0], pool=str(result["pool"]),
                                       device=str(result["device"]), share_id=result.get("shareID"), share=share))
    return devices


def base_request(name: str) -> str:
    """The request a result names without its subrequest (``gpu/h100`` -> ``gpu``): what the
    kubelet matches a container's ``resources.claims[].request`` against."""
    if not name:
        raise ValueError("a result names no request")
    return name.split("/", 1)[0]


def _label(key: tuple[str, int]) -> str:
    request, index = key
    return f"gpu-{index}" if request == REQUEST_NAME else f"{request}: gpu-{index}"
