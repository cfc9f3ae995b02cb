"""A DRA claim of Tessera's class, written in the tenant's cluster, as the host runs it.

The host never takes a claim of class ``gpu.tessera.dev`` from anyone but its own resourceclaim
controller, made from the translator's template (deploy/k8s/admission-policies.yaml): Tessera's
placement is the one allocator of those devices, and a claim made by hand would let the host's
scheduler allocate it around placement. So a tenant's claim is not copied as a claim: what it asks
for (a count of GPUs, a share of each one's ``memory`` and ``cores``) goes on the host pod's
containers that use it in HAMi's names, and the host's ordinary flow makes the host's claim
(webhook → template → the resourceclaim controller's claim, named by it and so collision-free in
the tenant's host namespace) → placement → kubelet plugin → CDI. What the host allocated is
copied back to the tenant's claim (`tenant_status`): the devices, and a node selector of the
virtual node, reserved for the tenant's pod.

Only what translates exactly is taken; the rest is refused with the path of the field that asked
for it: another device class, admin access, ``firstAvailable``, allocation mode ``All``, CEL
selectors, tolerations, opaque config, constraints, a capacity other than ``memory`` and
``cores``, more than one request in a claim, one claim used by two containers (the host would give
each its own share) or held by another pod. A pod can only name claims of its own namespace
(the tenant's API server refuses anything else), so no claim reaches another namespace.
Pure functions: `sync` reads the objects.
"""

from __future__ import annotations

from tessera.shared.hami_names import GPU, GPUCORES, GPUMEM
from tessera.shared.kubeclaims import DEVICE_CLASS
from tessera.shared.quantity import whole_mib

_EXACTLY = ("deviceClassName", "allocationMode", "count", "capacity")


def pod_claims(pod: dict) -> list[dict]:
    """The pod's ``spec.resourceClaims`` entries."""
    return list((pod.get("spec") or {}).get("resourceClaims") or [])


def source(entry: dict) -> tuple[str, str] | None:
    """(kind, name) of the object a pod claim entry names: its ResourceClaim or ResourceClaimTemplate."""
    if entry.get("resourceClaimName"):
        return "ResourceClaim", entry["resourceClaimName"]
    if entry.get("resourceClaimTemplateName"):
        return "ResourceClaimTemplate", entry["resourceClaimTemplateName"]
    return None


def claim_spec(obj: dict) -> dict:
    """The ResourceClaimSpec of a ResourceClaim, or of the claims a template makes."""
    if obj.get("kind") == "ResourceClaimTemplate":
        return (obj.get("spec") or {}).get("spec") or {}
    return obj.get("spec") or {}


def is_tesseras(spec: dict) -> bool:
    """Whether any request of the claim spec asks for Tessera's device class."""
    for request in (spec.get("devices") or {}).get("requests") or []:
        classes = [(request.get("exactly") or {}).get("deviceClassName")]
        classes += [s.get("deviceClassName") for s in request.get("firstAvailable") or []]
        if DEVICE_CLASS in classes:
            return True
    return False


def refusals(pod: dict, objects: dict[str, dict]) -> list[str]:
    """The fields of the pod's claims that the host must not take. ``objects``: pod claim name ->
    the ResourceClaim or ResourceClaimTemplate it names (with its ``kind``)."""
    refused: list[str] = []
    uid = pod["metadata"]["uid"]
    for i, entry in enumerate(pod_claims(pod)):
        obj = objects[entry["name"]]
        where = f"{obj['kind']} {obj['metadata']['name']}"
        refused += [f"{where}: {field}" for field in _spec_refusals(claim_spec(obj))]
        holders = [r.get("name") for r in (obj.get("status") or {}).get("reservedFor") or [] if r.get("uid") != uid]
        if holders:  # a claim is one pod's on the fleet
            refused.append(f"spec.resourceClaims[{i}].resourceClaimName ({where} is reserved for pod {holders[0]})")
    users: dict[str, list[str]] = {}
    for kind in ("initContainers", "containers"):
        for i, container in enumerate((pod.get("spec") or {}).get(kind) or []):
            for j, ref in enumerate((container.get("resources") or {}).get("claims") or []):
                users.setdefault(ref["name"], []).append(f"spec.{kind}[{i}].resources.claims[{j}]")
    for paths in users.values():
        if len(paths) > 1:  # each container would get its own share on the host: not one claim
            refused += [f"{path} (a claim shared by containers)" for path in paths[1:]]
    return refused


def _spec_refusals(spec: dict) -> list[str]:
    devices = spec.get("devices") or {}
    refused = [f"spec.devices.{k}" for k in ("config", "constraints") if devices.get(k)]
    requests = devices.get("requests") or []
    if len(requests) > 1:
        refused.append("spec.devices.requests[1]")
    for j, request in enumerate(requests[:1]):
        where = f"spec.devices.requests[{j}]"
        if "firstAvailable" in request:
            refused.append(f"{where}.firstAvailable")
            continue
        exactly = request.get("exactly") or {}
        if exactly.get("deviceClassName") != DEVICE_CLASS:
            refused.append(f"{where}.exactly.deviceClassName ({exactly.get('deviceClassName')}, not {DEVICE_CLASS})")
        if exactly.get("adminAccess"):
            refused.append(f"{where}.exactly.adminAccess")
        if exactly.get("allocationMode", "ExactCount") != "ExactCount":
            refused.append(f"{where}.exactly.allocationMode")
        refused += [f"{where}.exactly.{k}" for k in exactly if k not in _EXACTLY and k != "adminAccess"
                    and exactly[k] not in (None, [], {})]
        asked = (exactly.get("capacity") or {}).get("requests") or {}
        for key, value in asked.items():
            if key not in ("memory", "cores"):
                refused.append(f"{where}.exactly.capacity.requests[{key}]")
            elif key == "memory" and whole_mib(value) is None:
                refused.append(f"{where}.exactly.capacity.requests[memory] (not a whole number of MiB)")
            elif key == "cores" and not str(value).isdigit():
                refused.append(f"{where}.exactly.capacity.requests[cores] (not a whole number)")
    return refused


def limits(spec: dict) -> dict[str, str]:
    """What a claim spec that `refusals` passed asks for, in HAMi's names (a container's limits)."""
    [request] = (spec.get("devices") or {}).get("requests") or []
    exactly = request["exactly"]
    asked = (exactly.get("capacity") or {}).get("requests") or {}
    out = {GPU: str(exactly.get("count", 1))}
    if "memory" in asked:
        out[GPUMEM] = str(whole_mib(asked["memory"]))
    if "cores" in asked:
        out[GPUCORES] = str(asked["cores"])
    return out


def container_limits(pod: dict, objects: dict[str, dict]) -> dict[str, dict[str, str]]:
    """Container name -> the HAMi limits its claims stand for (the host pod's resources)."""
    out: dict[str, dict[str, str]] = {}
    for kind in ("initContainers", "containers"):
        for container in (pod.get("spec") or {}).get(kind) or []:
            for ref in (container.get("resources") or {}).get("claims") or []:
                if ref["name"] in objects:
                    out.setdefault(container["name"], {}).update(limits(claim_spec(objects[ref["name"]])))
    return out


def tenant_claim_name(pod: dict, entry: dict) -> str | None:
    """The name of the tenant's ResourceClaim a pod claim entry stands for (a template's: the one
    the tenant's resourceclaim controller made, once the pod's status names it)."""
    if entry.get("resourceClaimName"):
        return entry["resourceClaimName"]
    for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if status.get("name") == entry["name"]:
            return status.get("resourceClaimName")
    return None


def host_claim_name(host_pod: dict, container: str) -> str | None:
    """The host's ResourceClaim that a host pod's container uses (the translator's, by its template)."""
    spec = host_pod.get("spec") or {}
    refs = [r["name"] for kind in ("initContainers", "containers") for c in spec.get(kind) or []
            if c["name"] == container for r in (c.get("resources") or {}).get("claims") or []]
    for status in (host_pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if status.get("name") in refs:
            return status.get("resourceClaimName")
    return None


def tenant_status(host_claim: dict, tenant_claim: dict, pod: dict, node: str) -> dict | None:
    """The status the tenant's claim shows for the host's allocation (None: nothing allocated yet).
    The devices the host allocated (driver, pool, device: the host's real GPU), each result under
    the tenant's own request name; allocated to the virtual node; reserved for the tenant's pod."""
    allocation = (host_claim.get("status") or {}).get("allocation")
    if not allocation:
        return None
    [request] = (tenant_claim["spec"].get("devices") or {}).get("requests") or []
    results = [{"request": request["name"], **{k: r[k] for k in ("driver", "pool", "device") if k in r}}
               for r in (allocation.get("devices") or {}).get("results") or []]
    return {"allocation": {"devices": {"results": results},
                           "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                               {"key": "metadata.name", "operator": "In", "values": [node]}]}]}},
            "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}]}
