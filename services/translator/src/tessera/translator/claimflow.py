"""The translator's decisions on the Kubernetes path, pure: no client, no bus.

On Kubernetes a GPU pod's claim reaches Tessera as a ResourceClaim that Kubernetes' resourceclaim
controller makes from the webhook's template. Which tenant a namespace names, whether a
ResourceClaim is Tessera's, which Tessera claim and pod it stands for, what it asks for, and what a
reconciler must repair when the claims bucket and the API server disagree are decided here, so that
the watcher (``tessera.translator.kube`` does its I/O) and the tests share one answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from tessera.shared.events import ClaimRecord, ClaimSpec, TenantName, request_specs
from tessera.shared.kubeclaims import (DEVICE_CLASS, DRIVER, SCHEDULING_GATE, TENANT_LABEL,
                                       KubeClaimRef, claim_id, device_classes, device_requests)
from tessera.shared.lifecycle import release_route
from tessera.shared.podconstraints import PodConstraints, constraints_of

from tessera.translator import dra


class Unrecoverable(ValueError):
    """A ResourceClaim of the Tessera device class that Tessera cannot turn into a claim (the reason)."""


def namespace_tenant(namespace: Mapping | None) -> str | None:
    """The tenant a Namespace object names: its TENANT_LABEL label, else the annotation of that key."""
    metadata = (namespace or {}).get("metadata") or {}
    for field in ("labels", "annotations"):
        value = ((metadata.get(field) or {}).get(TENANT_LABEL) or "").strip()
        if value:
            return value
    return None


def tenant_problem(namespace: str, tenant: str | None) -> str | None:
    """Why pods of ``namespace`` cannot have Tessera GPUs with this tenant, or None if they can."""
    fix = (
        f"set the label {TENANT_LABEL}=<tenant> on the Namespace "
        f"(kubectl label namespace {namespace} {TENANT_LABEL}=<tenant>), or an annotation of that key"
    )
    if tenant is None:
        return f'namespace "{namespace}" names no Tessera tenant: {fix}'
    try:
        msgspec.convert(tenant, TenantName)
    except msgspec.ValidationError:
        return (
            f'namespace "{namespace}" names the tenant {tenant!r}, which is not a tenant name '
            f"(lowercase letters, digits and '-', at most 32): {fix}"
        )
    return None


def unknown_tenant(namespace: str, tenant: str) -> str:
    """What to say of ``namespace`` naming ``tenant`` (a tenant name) that Tessera does not have."""
    return (f'namespace "{namespace}" names the tenant {tenant!r} ({TENANT_LABEL}), which does not exist in '
            f"Tessera: create it with 'tessera tenant create {tenant}', or correct the Namespace's {TENANT_LABEL}")


def claim_ref(claim: Mapping) -> KubeClaimRef:
    """The ResourceClaim's identity, with the pod that owns it (the resourceclaim controller's owner)."""
    metadata = claim.get("metadata") or {}
    owner: dict = next(
        (o for o in metadata.get("ownerReferences") or [] if o.get("kind") == "Pod" and o.get("apiVersion") == "v1"),
        {},
    )
    return KubeClaimRef(
        namespace=metadata.get("namespace", ""),
        name=metadata.get("name", ""),
        uid=metadata.get("uid", ""),
        pod=owner.get("name", ""),
        pod_uid=owner.get("uid", ""),
    )


def tessera_id(claim: Mapping) -> str:
    return claim_id((claim.get("metadata") or {}).get("uid", ""))


def is_deleting(claim: Mapping) -> bool:
    return bool((claim.get("metadata") or {}).get("deletionTimestamp"))


def is_reserved(claim: Mapping) -> bool:
    """Whether a pod is still listed as using the claim (``status.reservedFor``)."""
    return bool((claim.get("status") or {}).get("reservedFor"))


def is_ended(claim: Mapping) -> bool:
    """A claim being deleted that no pod uses any more: its GPUs may be released. (One being
    deleted while a pod still uses it — a foreground delete, a hand-made delete — is not: its
    containers may still run. The delete-protection finalizer placement adds keeps it until then.)"""
    return is_deleting(claim) and not is_reserved(claim)


def is_allocated(claim: Mapping) -> bool:
    return bool((claim.get("status") or {}).get("allocation"))


def pod_constraints(pod: Mapping | None, ref: KubeClaimRef) -> PodConstraints | None:
    """What kube-scheduler's filters will read of the claim's pod (placement places only where they
    pass), or None if ``pod`` is not the claim's pod (gone, or a namesake)."""
    meta = (pod or {}).get("metadata") or {}
    if pod is None or not ref.pod or (ref.pod_uid and meta.get("uid") != ref.pod_uid):
        return None
    return constraints_of(pod)


def waits_unallocated(pod: Mapping | None, ref: KubeClaimRef) -> bool:
    """Whether the claim's pod still waits to be bound with our scheduling gate lifted: placement
    lifts it only once the claim's allocation is written, so a claim of such a pod that shows no
    allocation has had it taken away (by kube-scheduler, when it could not bind the pod there)."""
    meta = (pod or {}).get("metadata") or {}
    if pod is None or not ref.pod or (ref.pod_uid and meta.get("uid") != ref.pod_uid) or meta.get("deletionTimestamp"):
        return False
    spec = pod.get("spec") or {}
    gates = {g.get("name") for g in spec.get("schedulingGates") or [] if isinstance(g, Mapping)}
    return not spec.get("nodeName") and SCHEDULING_GATE not in gates


def recover_spec(claim: Mapping) -> ClaimSpec:
    """The translated claim a ResourceClaim carries in its (immutable) opaque config.

    The webhook's templates put the whole ClaimSpec there (``dra.parameters``), for all of the
    claim's requests; each request's count must agree with it, so that what placement allocates is
    what the ResourceClaim asks for.
    """
    devices = ((claim.get("spec") or {}).get("devices") or {})
    configs = [
        c for c in devices.get("config") or []
        if isinstance(c, Mapping) and isinstance(c.get("opaque"), Mapping) and c["opaque"].get("driver") == DRIVER
    ]
    if len(configs) != 1:
        raise Unrecoverable(
            f"spec.devices.config must hold exactly one opaque config of driver {DRIVER} (kind "
            f"{dra.PARAMETERS_KIND}, as the Tessera webhook's templates do); found {len(configs)}. Ask for GPUs "
            "with HAMi resource names on the pod instead of a hand-written claim"
        )
    try:
        spec = dra.spec_from_parameters(configs[0]["opaque"].get("parameters"))
    except ValueError as exc:
        raise Unrecoverable(f"spec.devices.config[].opaque: {exc}") from None
    names = dra.request_names(spec)
    configured = configs[0].get("requests") or names
    if sorted(configured) != sorted(names):
        raise Unrecoverable(f"spec.devices.config[] applies to requests {sorted(configured)} but its parameters "
                            f"describe requests {sorted(names)}")
    requests = {str(r.get("name")): r for r in device_requests(claim)}
    ours = sorted(name for name, r in requests.items() if DEVICE_CLASS in device_classes(r))
    if ours != sorted(names):
        raise Unrecoverable(f"spec.devices.requests of class {DEVICE_CLASS} are {ours} but its parameters describe "
                            f"requests {sorted(names)}")
    for name, (_, part) in zip(names, request_specs(spec)):
        request = requests[name]
        counts = (
            [request["exactly"].get("count", 1)] if isinstance(request.get("exactly"), Mapping)
            else [s.get("count", 1) for s in request.get("firstAvailable") or []]
        )
        if not counts or any(c != part.gpus for c in counts):
            raise Unrecoverable(
                f"spec.devices.requests[{name!r}] asks for {counts} devices but its parameters say gpus={part.gpus}"
            )
    return spec


@dataclass(frozen=True)
class Repairs:
    """What the reconciler publishes: ``requested`` for unrecorded claims, releases for orphans,
    and (``resend``) the releases of orphans already marked, which a translator that stopped between
    marking and publishing may never have sent. ``unallocated``: live ResourceClaims showing no
    allocation though their record says placement allocated them; either placement has not written
    the status yet or someone (kube-scheduler) took it back, which the pod tells
    (`waits_unallocated`)."""

    request: list[Mapping]
    release: list[ClaimRecord]
    resend: list[ClaimRecord]
    unallocated: tuple[Mapping, ...] = ()


def reconcile(claims: Iterable[Mapping], records: Iterable[ClaimRecord]) -> Repairs:
    """Compare the ResourceClaims of the Tessera device class with the ``claims`` bucket.

    ``records`` must have been read *before* ``claims`` were listed: then a live record whose
    ResourceClaim is missing from the list really lost it (its claim existed when the record was
    written), and a claim created in between shows up as unrecorded, which a create-only record
    write makes harmless.
    """
    live = {tessera_id(c): c for c in claims if not is_ended(c)}
    recorded = {r.claim: r for r in records}
    request = [c for cid, c in live.items() if cid not in recorded]
    orphans = [r for r in recorded.values()
               if r.kube is not None and r.claim not in live and release_route(r.state, r.node) is not None]
    unallocated = [c for cid, c in live.items() if cid in recorded and recorded[cid].state == "allocated"
                   and recorded[cid].kube is not None and not recorded[cid].release_requested
                   and not is_deleting(c) and not is_allocated(c)]
    return Repairs(request=request, release=[r for r in orphans if not r.release_requested],
                   resend=[r for r in orphans if r.release_requested], unallocated=tuple(unallocated))
