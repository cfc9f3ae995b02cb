"""TenantControlPlane objects on the host cluster: `kubectl apply -f` of one is a tenant.

The manager watches the custom resources (group tessera.io) and drives each through the same path
as the tenants API (`TenantApi.apply` / `TenantApi.remove`): an object's name is the tenant's name,
its spec the tenant's spec, and the object owns the tenant (recorded in the controlplanes bucket),
so the API cannot delete it from under the object and a second object of the same name elsewhere is
refused. Status goes through the status subresource: phase, endpoint, observedGeneration and two
conditions — ``Ready`` and ``Valid`` (False names the field of a spec the manager refused, msgspec's
path such as ``$.spec.network.podCidr``; the tenant keeps what it had). A bad object is reported
on that object and never stops the watch.

Deletion is guarded by the finalizer ``tessera.io/controlplane``, added on first sight: the API
server keeps the object until the manager has torn the tenant down (its claims released first, then
manifests, datastore, credentials, quota) and removed the finalizer. While the tenant's claims are
not all released the finalizer stays and the status says so (phase Deleting, reason
``ClaimsNotReleased`` and what is left); each resync tries again. An object deleted without it (finalizer removed by
hand) leaves an orphan tenant, which the next full list notices and removes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from typing import Any

import msgspec

from tessera.controlplane.api import TenantApi
from tessera.controlplane.capacity import InsufficientCapacity
from tessera.controlplane.kube import TenantControlPlanes
from tessera.controlplane.spec import (
    Condition,
    ResourceRef,
    SpecError,
    TenantControlPlane,
    TenantControlPlaneStatus,
    check_name,
    parse_spec,
)
from tessera.controlplane.store import TenantStore
from tessera.shared.errors import ConflictError
from tessera.shared.kubeapi import Conflict, KubeError

log = logging.getLogger("tessera.controlplane.resources")

FINALIZER = "tessera.io/controlplane"


class Refused(Exception):
    """The object cannot be served as it is; ``reason`` and the message go into its status."""

    def __init__(self, reason: str, message: str, field: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.field = field


def _ref(obj: dict[str, Any]) -> ResourceRef:
    meta = obj["metadata"]
    return ResourceRef(namespace=meta["namespace"], name=meta["name"], uid=meta.get("uid", ""))


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def desired_status(obj: dict[str, Any], record: TenantControlPlane | None, refused: Refused | None) -> dict:
    """The status the object should show: the tenant's observed state, and the two conditions."""
    generation = int(obj["metadata"].get("generation") or 1)
    status = msgspec.structs.replace(record.status) if record is not None else TenantControlPlaneStatus(phase="NotReady")
    if refused is not None and (record is None or not refused.field):
        # (a refused change to a working tenant leaves its state as it was; Valid says why)
        status.reason, status.message = refused.reason, str(refused)
    status.observed_generation = generation
    ready = record is not None and status.phase == "Ready"
    invalid = refused is not None and refused.field
    status.conditions = [
        Condition(type="Ready", status="True" if ready else "False", reason=status.reason or status.phase,
                  message=status.message, observed_generation=generation),
        Condition(type="Valid", status="False" if invalid else "True", reason="InvalidSpec" if invalid else "Accepted",
                  message=f"{refused.field}: {refused}" if refused is not None and invalid else "",
                  observed_generation=generation),
    ]
    # a condition keeps its transition time while its status stays what it was
    before = {c.get("type"): c for c in ((obj.get("status") or {}).get("conditions") or [])}
    stamp = _rfc3339(time.time())
    for c in status.conditions:
        old = before.get(c.type) or {}
        kept = old.get("status") == c.status and old.get("lastTransitionTime")
        c.last_transition_time = old["lastTransitionTime"] if kept else stamp
    return msgspec.to_builtins(status)


def _same(current: dict | None, wanted: dict) -> bool:
    """Whether the status shown already says ``wanted`` (its own timestamp aside)."""
    if not current:
        return False
    return {k: v for k, v in current.items() if k != "lastTransition"} == \
        {k: v for k, v in wanted.items() if k != "lastTransition"}


class TenantResources:
    def __init__(self, tenants: TenantApi, store: TenantStore, objects: TenantControlPlanes) -> None:
        self.tenants = tenants
        self.store = store
        self.objects = objects

    async def run(self) -> None:
        """Forever: serve every object listed (and remove orphans), then follow the watch from there."""
        while True:
            try:
                version = await self.resync()
                async for kind, obj in self.objects.watch(version):
                    if kind == "DELETED":
                        await self._gone(obj)
                    elif not _served(obj):
                        await self.handle(obj)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # refused (the CRD not installed, RBAC): say so, try again later
                log.warning("TenantControlPlane objects cannot be listed (%s); retrying", exc)
                await asyncio.sleep(10)

    async def resync(self) -> str:
        """Serve every object as listed now and remove orphaned tenants; the list's resourceVersion."""
        items, version = await self.objects.list()
        for obj in items:
            await self.handle(obj)
        await self.sweep(items)
        return version

    async def handle(self, obj: dict[str, Any]) -> None:
        """Serve one object as it is now; every failure ends up in its status or the log, never here."""
        meta = obj.get("metadata") or {}
        try:
            if meta.get("deletionTimestamp"):
                await self._delete(obj)
                return
            if FINALIZER not in (meta.get("finalizers") or []):
                obj = await self.objects.set_finalizers(obj, [*(meta.get("finalizers") or []), FINALIZER])
            record, refused = await self._serve(obj)
            status = desired_status(obj, record, refused)
            if not _same(obj.get("status"), status):
                await self.objects.set_status(obj, status)
        except asyncio.CancelledError:
            raise
        except Conflict:  # changed under us: the watch brings the new version
            return
        except KubeError as exc:
            log.warning("TenantControlPlane %s/%s: %s", meta.get("namespace"), meta.get("name"), exc)
        except Exception:
            log.exception("TenantControlPlane %s/%s", meta.get("namespace"), meta.get("name"))

    async def report(self, tenant: str) -> None:
        """The tenant changed (its control plane became ready, say): show it on its object."""
        stored = await self.store.controlplanes.get(tenant)
        ref = stored.value.resource if stored is not None else None
        if ref is None:
            return
        obj = await self.objects.get(ref.namespace, ref.name)
        if obj is not None:
            await self.handle(obj)

    async def sweep(self, items: list[dict[str, Any]]) -> None:
        """Tear down tenants whose object is gone (deleted while its finalizer had been removed)."""
        present = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in items}
        for name in await self.store.controlplanes.keys():
            stored = await self.store.controlplanes.get(name)
            ref = stored.value.resource if stored is not None else None
            if stored is not None and ref is not None and (ref.namespace, ref.name) not in present:
                log.warning("tenant %s: its TenantControlPlane %s/%s is gone; removing it", name, ref.namespace,
                            ref.name)
                await self._remove(name, stored.value)

    async def _remove(self, name: str, record: TenantControlPlane):
        """Tear the tenant down; one already deleting (a resumed deletion) is looked at without
        waiting, so a stuck tenant does not hold up the watch."""
        return await self.tenants.remove(name, wait=0.0 if record.deleting else None)

    async def _serve(self, obj: dict[str, Any]) -> tuple[TenantControlPlane | None, Refused | None]:
        ref = _ref(obj)
        stored = await self.store.controlplanes.get(ref.name) if _valid_name(ref.name) else None
        current = stored.value if stored is not None and _owned(stored.value, ref) else None
        try:
            name = check_name(ref.name)
        except SpecError as exc:
            return None, Refused("InvalidName", str(exc), "$.metadata.name")
        try:
            spec = parse_spec(obj.get("spec"))
        except SpecError as exc:
            return current, Refused("InvalidSpec", str(exc), f"$.{exc.field}")
        try:
            return await self.tenants.apply(name, spec, ref), None
        except InsufficientCapacity as exc:
            return current, Refused("InsufficientCapacity", str(exc))
        except ConflictError as exc:
            return current, Refused("Conflict", str(exc))

    async def _delete(self, obj: dict[str, Any]) -> None:
        finalizers = obj["metadata"].get("finalizers") or []
        if FINALIZER not in finalizers:
            return
        ref = _ref(obj)
        stored = await self.store.controlplanes.get(ref.name) if _valid_name(ref.name) else None
        if stored is not None and _owned(stored.value, ref):
            removal = await self._remove(ref.name, stored.value)
            if removal.pending:  # its claims still hold GPUs: the object stays, and says why
                current = await self.store.controlplanes.get(ref.name)
                status = desired_status(obj, current.value if current else stored.value, None)
                if not _same(obj.get("status"), status):
                    await self.objects.set_status(obj, status)
                return
            log.info("tenant %s removed with its TenantControlPlane %s/%s", ref.name, ref.namespace, ref.name)
        await self.objects.set_finalizers(obj, [f for f in finalizers if f != FINALIZER])

    async def _gone(self, obj: dict[str, Any]) -> None:
        """An object vanished: if it still owned a tenant (its finalizer was removed by hand), remove it."""
        ref = _ref(obj)
        stored = await self.store.controlplanes.get(ref.name) if _valid_name(ref.name) else None
        if stored is not None and _owned(stored.value, ref):
            await self._remove(ref.name, stored.value)


def _served(obj: dict[str, Any]) -> bool:
    """Whether a watch event only shows what the manager itself wrote (its status, its finalizer):
    this generation was served already, so another pass would change nothing."""
    meta = obj.get("metadata") or {}
    observed = (obj.get("status") or {}).get("observedGeneration")
    return not meta.get("deletionTimestamp") and FINALIZER in (meta.get("finalizers") or []) and \
        observed is not None and observed == meta.get("generation")


def _owned(record: TenantControlPlane, ref: ResourceRef) -> bool:
    owner = record.resource
    return owner is not None and (owner.namespace, owner.name) == (ref.namespace, ref.name)


def _valid_name(name: str) -> bool:
    try:
        check_name(name)
        return True
    except SpecError:
        return False
