"""The names a Tessera claim and a Kubernetes ResourceClaim share, defined once.

On Kubernetes one ResourceClaim of driver ``gpu.tessera.dev`` is one Tessera claim. Four services
meet on it — the translator publishes ``requested`` for it, placement writes its
``status.allocation`` and lifts the pod's scheduling gate, the capacity publisher names the devices
the allocation points at, the enforcer (the kubelet plugin) checks that allocation against the
ledger — and each must derive the same claim id, device names and pool from the same facts. They
live here, pure (no Kubernetes client), so that no two services can disagree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from msgspec import Struct

DRIVER = "gpu.tessera.dev"
DEVICE_CLASS = "gpu.tessera.dev"
RESOURCE_API_VERSION = "resource.k8s.io/v1"
# The one device request of every claim the translator's templates render.
REQUEST_NAME = "gpu"
# The scheduling gate the webhook puts on a GPU pod; placement removes it once the pod's claims are
# allocated, and only then may kube-scheduler bind the pod.
SCHEDULING_GATE = "gpu.tessera.dev/placement"
# Label (or annotation) on a Namespace that names the tenant its pods belong to. A GPU pod in a
# namespace without one is refused at admission.
TENANT_LABEL = "tessera.io/tenant"

_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


class KubeClaimRef(Struct, frozen=True, kw_only=True):
    """The Kubernetes ResourceClaim a Tessera claim stands for (set in Kubernetes mode only)."""

    namespace: str
    name: str
    uid: str
    # The pod the claim was made for (the resourceclaim controller's owner reference): the pod whose
    # scheduling gate placement lifts and on which Events about the claim are reported.
    pod: str = ""
    pod_uid: str = ""


def claim_id(uid: str) -> str:
    """The Tessera claim id of the ResourceClaim with this ``metadata.uid``: ``k8s-<uid>``.

    Deterministic, so a translator restarted (or two of them) publishes the same id for the same
    claim, and the stream's duplicate window and the ``claims`` bucket's create-only write make a
    repeat harmless. A uid that is not an RFC 4122 UUID (as the API server assigns) is refused.
    """
    uid = uid.strip().lower()
    if not _UID.match(uid):
        raise ValueError(f"ResourceClaim uid {uid!r} is not a UUID as the API server assigns")
    return f"k8s-{uid}"


def is_kube_claim(claim: str) -> bool:
    return claim.startswith("k8s-") and bool(_UID.match(claim[4:]))


def device_name(index: int) -> str:
    """The DRA device name of the GPU with this index on its node (``gpu-<index>``)."""
    return f"gpu-{index}"


def device_index(name: str) -> int:
    """The GPU index a DRA device name stands for; ValueError for a name Tessera never publishes."""
    match = re.fullmatch(r"gpu-(0|[1-9][0-9]{0,3})", name)
    if not match:
        raise ValueError(f"device {name!r} is not a {DRIVER} device name (gpu-<index>)")
    return int(match.group(1))


def pool_name(node: str) -> str:
    """The DRA pool of a node's GPUs: one pool per node, named after it."""
    return node


def device_requests(claim: Mapping) -> list[Mapping]:
    """The DeviceRequests of a ResourceClaim (or of a template's claim spec, under ``spec``)."""
    devices = ((claim.get("spec") or {}).get("devices") or {})
    return [r for r in devices.get("requests") or [] if isinstance(r, Mapping)]


def device_classes(request: Mapping) -> list[str]:
    """The device classes one DeviceRequest asks for (each of a ``firstAvailable`` list's)."""
    if isinstance(request.get("exactly"), Mapping):
        return [request["exactly"].get("deviceClassName", "")]
    return [s.get("deviceClassName", "") for s in request.get("firstAvailable") or [] if isinstance(s, Mapping)]


def is_tessera_claim(claim: Mapping) -> bool:
    """Whether any request of the ResourceClaim asks for the Tessera device class."""
    return any(DEVICE_CLASS in device_classes(r) for r in device_requests(claim))
