"""The Kubernetes feature gate Tessera cannot run without, told from what the API server kept.

Sharing a GPU between claims is DRA consumable capacity (`DRAConsumableCapacity`: alpha and off in
1.34 and 1.35, beta and on from 1.36). With the gate off the API server accepts every write and
silently drops the fields it guards — a device's `allowMultipleAllocations`, its capacities'
`requestPolicy`, a request's `capacity`, a result's `shareID` and `consumedCapacity` — so a
slice would offer each GPU once and an allocation would claim a whole card. Nothing errors; the
fleet is simply wrong. So each writer compares what it wrote with what the server answered and,
where a gated field is gone, refuses with an error that names the gate.

Device taints (`DRADeviceTaints`: alpha and off in 1.33-1.35, beta and on in 1.36) are dropped the
same way when off; a tainted GPU would then look healthy to every DRA allocator. That gate is not
needed to share GPUs, so it is told (`taints_dropped`) and the writer leaves sick GPUs out instead.
"""

from __future__ import annotations

from typing import Any, Iterator

from tessera.shared.errors import PermanentError

CONSUMABLE_CAPACITY = "DRAConsumableCapacity"
# The fields the gate guards, by the name of their key in resource.k8s.io/v1 objects. ("capacity"
# is gated only inside a device request; a slice device's own capacity is not.)
GATED = ("allowMultipleAllocations", "requestPolicy", "shareID", "consumedCapacity")
DEVICE_TAINTS = "DRADeviceTaints"
SUPPORTED = "Kubernetes 1.36 or later (DRAConsumableCapacity is on by default there)"


class FeatureGateOff(PermanentError):
    """The API server dropped fields a feature gate guards; the message names the gate and the fix."""


Path = tuple[str | int, ...]


def _gated_paths(obj: Any, path: Path = (), in_request: bool = False) -> Iterator[Path]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in GATED or (in_request and key == "capacity"):
                yield (*path, key)
            yield from _gated_paths(value, (*path, key), in_request or key in ("exactly", "firstAvailable"))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _gated_paths(value, (*path, i), in_request)


def _present(obj: Any, path: Path) -> bool:
    for part in path:
        if isinstance(part, int):
            if not isinstance(obj, list) or part >= len(obj):
                return False
        elif not isinstance(obj, dict) or part not in obj:
            return False
        obj = obj[part]
    return True


def _spell(path: Path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def dropped(wrote: dict, stored: dict) -> list[str]:
    """The gated fields present in ``wrote`` and missing from ``stored`` (the server's answer)."""
    return [_spell(p) for p in _gated_paths(wrote) if not _present(stored, p)]


def require_consumable_capacity(what: str, wrote: dict, stored: dict) -> None:
    """Raise FeatureGateOff if the API server dropped a consumable-capacity field of ``wrote``."""
    gone = dropped(wrote, stored)
    if gone:
        names = ", ".join(sorted({path.rsplit(".", 1)[-1] for path in gone}))
        raise FeatureGateOff(
            f"the API server dropped {names} from {what} ({len(gone)} fields, the first {gone[0]}): the "
            f"{CONSUMABLE_CAPACITY} feature gate is off there, and without it no GPU can be shared. Enable it "
            f"(kube-apiserver, kube-scheduler, kube-controller-manager and kubelet: "
            f"--feature-gates={CONSUMABLE_CAPACITY}=true), or run {SUPPORTED}")


def _tainted(slice_obj: dict) -> int:
    return sum(1 for d in (slice_obj.get("spec") or {}).get("devices") or [] if d.get("taints"))


def taints_dropped(wrote: dict, stored: dict) -> bool:
    """Whether the API server kept none of the device taints of the ResourceSlice ``wrote``."""
    return _tainted(wrote) > 0 and _tainted(stored) == 0
