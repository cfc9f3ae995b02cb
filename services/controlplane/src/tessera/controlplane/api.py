"""The manager's request/reply API: create, get, list and delete tenants over core NATS.

Requests are user input (the CLI, outside tools): they are decoded strictly and every refusal is a
reply that names the field, never an exception that reaches the bus. Create and delete only record
the desired state (compare-and-set on the controlplanes bucket) and then run one reconcile pass, so
the reply already reports the phase the tenant reached; a repeated create with the same spec
changes nothing. Sleep and wake record the tenant's ``asleep`` the same way (its Deployment is then
rendered with zero replicas, or the spec's again); a wake replies once the tenant is Ready.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
import uuid
from typing import Awaitable, Callable, Mapping

import msgspec

from tessera.controlplane.capacity import HostCapacity, InsufficientCapacity, check_fits
from tessera.controlplane.reconciler import Reconciler
from tessera.controlplane.spec import (
    ResourceRef,
    SpecError,
    TenantControlPlane,
    TenantControlPlaneSpec,
    check_name,
    parse_spec,
)
from tessera.controlplane.store import TenantStore
from tessera.shared import api
from tessera.shared.api import TenantRequest
from tessera.shared.errors import ConflictError
from tessera.shared.events import GpuQuota
from tessera.shared.ledger import Ledger, borrowed, held_by_tenant

log = logging.getLogger("tessera.controlplane.api")

WAKE_TIMEOUT = 120.0  # how long a wake waits for the API server to answer before it replies
WAKE_POLL = 0.1  # how often a wake asks the host whether the control plane serves (its figure's grain)

_request_decoder = msgspec.json.Decoder(TenantRequest)

Handler = Callable[[bytes, Mapping[str, str]], Awaitable[bytes]]


class TenantView(msgspec.Struct, kw_only=True):
    """What create/get/list return: the summary a table shows, plus the full spec."""

    name: str
    phase: str
    reason: str
    message: str
    quota: GpuQuota
    size: str
    driver: str
    datastore: str
    endpoint: str
    kubernetes_version: str
    replicas: int
    generation: int
    observed_generation: int
    created: float
    deleting: bool = False
    asleep: bool = False  # scaled to zero (`tessera tenant sleep`, the idle timeout) until a wake
    wake_seconds: float = 0.0  # the last wake, until Ready
    gpu_pods: str = ""  # Kubernetes mode: its GPU pod syncer's state (Starting, Syncing, Failed: why)
    spec: dict = {}
    # Fair share: ``quota`` is what it is guaranteed; it may borrow up to ``borrowing_limit`` more
    # (None: no borrowing). ``in_use``: what its claims hold in the ledger; ``borrowed``: how much
    # of that lies beyond its guarantee (None where the ledger was not read).
    borrowing_limit: GpuQuota | None = None
    weight: int = 1
    in_use: GpuQuota | None = None
    borrowed: GpuQuota | None = None


def view(record: TenantControlPlane, held: dict[str, GpuQuota] | None = None) -> TenantView:
    """The tenant as create/get/list show it; ``held``: what each tenant's claims hold (the ledger)."""
    quota = record.spec.quota.to_quota()
    in_use = None if held is None else held.get(record.name, GpuQuota(gpus=0, memory_mib=0, cores=0))
    return TenantView(
        name=record.name,
        phase="Deleting" if record.deleting else record.status.phase,
        reason=record.status.reason,
        message=record.status.message,
        quota=quota,
        borrowing_limit=record.spec.quota.borrowing(),
        weight=record.spec.quota.weight,
        in_use=in_use,
        borrowed=None if in_use is None else borrowed(quota, in_use),
        size=record.spec.size,
        driver=record.spec.datastore.driver,
        datastore=record.status.datastore,
        endpoint=record.status.endpoint,
        kubernetes_version=record.spec.kubernetes.version,
        replicas=record.spec.kubernetes.replicas,
        generation=record.generation,
        observed_generation=record.status.observed_generation,
        created=record.created,
        deleting=record.deleting,
        asleep=record.asleep,
        wake_seconds=record.status.wake_seconds,
        gpu_pods=record.status.gpu_pods,
        spec=msgspec.to_builtins(record.spec),
    )


class Removal(msgspec.Struct, frozen=True):
    existed: bool
    pending: bool = False  # its claims are not all released yet: the tenant is still there, deleting
    reason: str = ""
    message: str = ""


class TenantApi:
    def __init__(self, store: TenantStore, reconciler: Reconciler, capacity: HostCapacity,
                 ledger: Ledger | None = None) -> None:
        """``ledger``: where get and list read what each tenant's claims hold (None: not shown)."""
        self.ledger = ledger
        self.store = store
        self.reconciler = reconciler
        self.capacity = capacity
        self._admission = asyncio.Lock()  # one capacity decision at a time in this process

    def handlers(self) -> dict[str, Handler]:
        return {"create": self.create, "get": self.get, "list": self.list, "delete": self.delete,
                "kubeconfig": self.kubeconfig, "sleep": self.sleep, "wake": self.wake}

    async def create(self, data: bytes, headers: Mapping[str, str]) -> bytes:
        async def act(req: TenantRequest) -> bytes:
            record = await self.apply(check_name(req.name), parse_spec(req.spec, req.quota))
            return api.ok(view(record, await self._held()))

        return await self._guard(data, act)

    async def apply(self, name: str, spec: TenantControlPlaneSpec, resource: ResourceRef | None = None,
                    ) -> TenantControlPlane:
        """Create the tenant or change its spec, then run one reconcile pass: what create does, and
        what a TenantControlPlane object (``resource``, which then owns the tenant) does."""
        async with self._admission:
            record = await self._admit(name, spec, resource)
        return await self.reconciler.reconcile(name) or record

    async def remove(self, name: str, *, wait: float | None = None) -> "Removal":
        """Mark the tenant deleting and tear it down (also finishing an interrupted teardown and
        cleaning orphans): its claims are released first, waiting up to ``wait`` seconds (default:
        the teardown wait); whether it existed, and whether its deletion is still pending."""
        def mark(record: TenantControlPlane | None) -> TenantControlPlane | None:
            return record if record is None or record.deleting else msgspec.structs.replace(record, deleting=True)

        stored, _ = await self.store.controlplanes.modify(name, mark)  # ConflictError if it never wins
        existed = stored is not None
        left = await self.reconciler.reconcile(name, wait=wait)
        if not existed and await self.store.tenants.get(name) is not None:
            await self.reconciler.resync(wait=self.reconciler.teardown_wait if wait is None else wait)
        if left is not None:
            return Removal(existed, pending=True, reason=left.status.reason, message=left.status.message)
        return Removal(existed)

    async def get(self, data: bytes, headers: Mapping[str, str]) -> bytes:
        async def act(req: TenantRequest) -> bytes:
            name = check_name(req.name)
            stored = await self.store.controlplanes.get(name)
            if stored is None:
                return api.error(f"tenant {name!r} does not exist", field="name", code="not-found")
            return api.ok(view(stored.value, await self._held()))

        return await self._guard(data, act)

    async def list(self, data: bytes, headers: Mapping[str, str]) -> bytes:
        async def act(req: TenantRequest) -> bytes:
            records = await self._all()
            held = await self._held()
            return api.ok([view(r, held) for r in records])

        return await self._guard(data or b"{}", act)

    async def delete(self, data: bytes, headers: Mapping[str, str]) -> bytes:
        async def act(req: TenantRequest) -> bytes:
            name = check_name(req.name)
            stored = await self.store.controlplanes.get(name)
            owner = stored.value.resource if stored is not None else None
            if owner is not None:  # the controller would only create it again
                raise ConflictError(f"tenant {name!r} belongs to TenantControlPlane {owner.namespace}/{owner.name};"
                                    f" delete it there: kubectl delete tcp -n {owner.namespace} {owner.name}")
            removal = await self.remove(name)
            reply = {"name": name, "deleted": not removal.pending, "existed": removal.existed}
            if removal.pending:  # not done: said so, and the manager goes on with it
                reply.update(pending=True, reason=removal.reason, message=removal.message)
            return api.ok(reply)

        return await self._guard(data, act)

    async def kubeconfig(self, data: bytes, headers: Mapping[str, str]) -> bytes:
        """The tenant's admin kubeconfig (its API server's address, its CA, an admin certificate)."""
        async def act(req: TenantRequest) -> bytes:
            name = check_name(req.name)
            stored = await self.store.secrets.get(name)
            if stored is None or not stored.value.kubeconfig:
                return api.error(f"tenant {name!r} has no kubeconfig (it does not exist, or is not provisioned yet)",
                                 field="name", code="not-found")
            return api.ok({"name": name, "kubeconfig": stored.value.kubeconfig})

        return await self._guard(data, act)

    async def sleep(self, data: bytes, headers: Mapping[str, str]) -> bytes:
        """Scale the tenant's control plane to zero, keeping its data."""
        return await self._guard(data, lambda req: self._sleep_or_wake(req, asleep=True))

    async def wake(self, data: bytes, headers: Mapping[str, str]) -> bytes:
        """Scale it back and wait until it is Ready; the reply says how long it took."""
        return await self._guard(data, lambda req: self._sleep_or_wake(req, asleep=False))

    async def set_asleep(self, name: str, asleep: bool) -> TenantControlPlane | None:
        """Record that the tenant sleeps (or is to wake), then one reconcile pass, which scales its
        Deployment; what is stored now (None: no such tenant). Also the idle timeout's way in."""
        def change(record: TenantControlPlane | None) -> TenantControlPlane | None:
            if record is None or record.asleep == asleep:
                return None
            if record.deleting:
                raise ConflictError(f"tenant {name!r} is being deleted: it is not put to sleep or woken")
            return msgspec.structs.replace(record, asleep=asleep, waking_since=0.0 if asleep else time.time())

        current, _ = await self.store.controlplanes.modify(name, change)
        if current is None:
            return None
        return await self.reconciler.reconcile(name)

    async def _sleep_or_wake(self, req: TenantRequest, *, asleep: bool) -> bytes:
        name = check_name(req.name)
        loop = asyncio.get_running_loop()
        started = loop.time()
        record = await self.set_asleep(name, asleep)
        if record is None:
            return api.error(f"tenant {name!r} does not exist", field="name", code="not-found")
        while not asleep and not record.asleep and record.status.phase != "Ready":
            if loop.time() > started + WAKE_TIMEOUT:
                break  # the reply shows where it stands (Waking, or what is wrong)
            await asyncio.sleep(WAKE_POLL)
            record = await self.reconciler.look(name)
            if record is None:
                return api.error(f"tenant {name!r} was deleted while it was waking", field="name", code="not-found")
        if not asleep and record.asleep:
            return api.error(f"tenant {name!r} was put to sleep again before its API server answered (`tessera "
                             f"tenant sleep`, or the idle timeout); wake it again", code="conflict")
        return api.ok({"tenant": view(record), "seconds": round(loop.time() - started, 3)})

    async def _admit(self, name: str, spec: TenantControlPlaneSpec, resource: ResourceRef | None = None,
                     ) -> TenantControlPlane:
        """Store the desired spec (new tenant, or a changed spec); an identical create is a no-op.
        A tenant owned by one TenantControlPlane object is not another's (nor the API's) to change."""
        for _ in range(20):
            stored = await self.store.controlplanes.get(name)
            if stored is not None and stored.value.deleting:
                raise ConflictError(f"tenant {name!r} is being deleted; retry once it is gone")
            owner = stored.value.resource if stored is not None else None
            if owner is not None and (resource is None or (owner.namespace, owner.name) != (resource.namespace,
                                                                                          resource.name)):
                raise ConflictError(f"tenant {name!r} belongs to TenantControlPlane {owner.namespace}/{owner.name};"
                                    " change or delete it there")
            if stored is not None and stored.value.spec == spec and owner == resource:
                return stored.value
            if self.capacity.cpu_millis or self.capacity.memory_mib:
                check_fits(self.capacity, await self._all(), name, spec)
            if stored is None:
                record = TenantControlPlane(name=name, uid=uuid.uuid4().hex[:12], spec=spec, resource=resource)
                revision = None
            else:
                changed = stored.value.spec != spec
                record = msgspec.structs.replace(
                    stored.value, spec=spec, resource=resource or owner,
                    generation=stored.value.generation + changed,
                )
                revision = stored.revision
            try:
                await self.store.controlplanes.put(name, record, revision=revision)
                return record
            except ConflictError:
                continue
        raise ConflictError(f"tenant {name!r} kept changing; retry")

    async def _held(self) -> dict[str, GpuQuota] | None:
        """What each tenant's claims hold, from every node's ledger (None without a ledger)."""
        if self.ledger is None:
            return None
        return held_by_tenant((await self.ledger.all_nodes()).values())

    async def _all(self) -> builtins.list[TenantControlPlane]:
        records = []
        for key in await self.store.controlplanes.keys():
            stored = await self.store.controlplanes.get(key)
            if stored is not None:
                records.append(stored.value)
        return records

    async def _guard(self, data: bytes, act: Callable[[TenantRequest], Awaitable[bytes]]) -> bytes:
        """Decode strictly and turn every failure into an error reply: nothing escapes to the bus."""
        try:
            req = _request_decoder.decode(data)
        except msgspec.ValidationError as exc:
            message, path = api.describe_validation_error(exc)
            return api.error(message, field=path.removeprefix("$").lstrip("."))
        except msgspec.DecodeError as exc:
            return api.error(f"request is not valid JSON: {exc}")
        try:
            return await act(req)
        except SpecError as exc:
            return api.error(str(exc), field=exc.field)
        except InsufficientCapacity as exc:
            return api.error(str(exc), field="spec", code="insufficient-capacity")
        except ConflictError as exc:
            return api.error(str(exc), code="conflict")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("tenant request failed")
            return api.error(f"{type(exc).__name__}: {exc}", code="unavailable")
