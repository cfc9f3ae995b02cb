"""NodePrepareResources and NodeUnprepareResources: what the kubelet's DRA calls do on this node.

Prepare, per claim: read the ResourceClaim, check its allocation against this node, the driver and
the ledger (allocation.py), write ``preparing`` to the checkpoint, make the claim's directory and
CDI spec (the same ``Preparation.materialize`` the bus path uses), write ``prepared``, answer the
CDI device ids. A claim prepared before is answered from the checkpoint with the same ids. One
claim's failure is that claim's error; the others go on. Unprepare removes the CDI spec and the
directory; it never releases the ledger — deleting the ResourceClaim does that, through the
translator's release.

Both run under one node-wide lock: an asyncio lock for this process and an flock on a file in
the plugin directory for any other instance (a rolling update starts the new plugin beside the
old). Under it the checkpoint is read afresh, so what another instance wrote counts, and repaired
first: from another boot it is dropped with what it names; a ``preparing`` entry is rolled back;
a corrupt file is kept aside and the entries rebuilt from the claim directories' own records.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

import msgspec

from tessera.shared.claimstore import ClaimStore
from tessera.shared.errors import TemporaryError
from tessera.shared.events import ClaimRecord, GpuDevice
from tessera.shared.kubeclaims import claim_id, is_kube_claim
from tessera.shared.ledger import Ledger
from tessera.shared.telemetry import CLAIM, NODE, claim_attributes

from tessera.enforcer.kubelet import allocation
from tessera.enforcer.kubelet.checkpoint import (
    Body,
    Checkpoint,
    CheckpointClaim,
    CheckpointDevice,
    CorruptCheckpoint,
    boot_id,
    claim_decoder,
    write_atomically,
)
from tessera.enforcer.preparation import Prepared, Preparation
from tessera.enforcer.settings import EnforcerSettings

log = logging.getLogger("tessera.enforcer.kubelet")

CHECKPOINT = "checkpoint.json"
LOCK = "plugin.lock"
# What Kubernetes allows as a namespace (DNS-1123 label) and a ResourceClaim name (DNS-1123
# subdomain). Checked before the read: an empty name would make it a list of every claim, a '/'
# another path, and either would come back as the API server's trouble instead of the kubelet's.
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class PrepareResult:
    devices: list[CheckpointDevice]
    error: str = ""


class DraPlugin:
    def __init__(
        self,
        settings: EnforcerSettings,
        preparation: Preparation,
        ledger: Ledger,
        claims: ClaimStore,
        reader,
        *,
        inventory: Callable[[], Awaitable[Mapping[str, GpuDevice]]],
        announce: Callable[[ClaimRecord, Prepared], Awaitable[None]],
        span: Callable[..., contextlib.AbstractContextManager] | None = None,
    ) -> None:
        self.settings = settings
        self.node = settings.node
        self.preparation = preparation
        self.ledger = ledger
        self.claims = claims
        self.reader = reader
        self.inventory = inventory
        self.announce = announce
        # Telemetry.span: a claim's prepare continues the claim's trace (one claim, one trace).
        self.span = span or (lambda *a, **k: contextlib.nullcontext())
        self.checkpoint = Checkpoint(settings.kubelet_plugin_dir / CHECKPOINT)
        self.boot = boot_id(settings.boot_id_file)
        self._lock = asyncio.Lock()
        # Set when the checkpoint is corrupt and could not even be moved aside: nothing can be
        # recorded, so nothing new is prepared until an operator removes it.
        self.broken = ""

    # --- the node-wide lock and the checkpoint under it ---------------------------------------

    @contextlib.asynccontextmanager
    async def locked(self):
        async with self._lock:
            self.settings.kubelet_plugin_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.settings.kubelet_plugin_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # drops the flock

    def load(self) -> Body:
        """The checkpoint as it stands, repaired (call under the lock)."""
        try:
            body = self.checkpoint.read(self.boot)
            self.broken = ""
        except CorruptCheckpoint as exc:
            body = self._recover(str(exc))
        changed = False
        if body.boot_id != self.boot:
            log.warning("the checkpoint %s is from boot %s, this is boot %s: the node rebooted, so nothing it "
                        "names is prepared any more; removing what is left of %d claim(s)",
                        self.checkpoint.path, body.boot_id, self.boot, len(body.claims))
            for entry in body.claims.values():
                self.preparation.remove(entry.claim)
            body, changed = Body(boot_id=self.boot), True
        for uid, entry in list(body.claims.items()):
            if entry.state == "preparing":
                log.warning("rolling back the unfinished prepare of ResourceClaim %s/%s (%s)",
                            entry.namespace, entry.name, entry.claim)
                self.preparation.remove(entry.claim)
                del body.claims[uid]
                changed = True
        if changed and not self.broken:
            self.checkpoint.write(body)
        return body

    def _recover(self, problem: str) -> Body:
        try:
            aside = self.checkpoint.set_aside()
        except OSError as exc:
            self.broken = (f"the checkpoint {self.checkpoint.path} {problem} and could not be moved aside ({exc}); "
                           "nothing is prepared until it is removed")
            log.error("%s", self.broken)
            return self._rebuild()
        self.broken = ""
        body = self._rebuild()
        log.error("the checkpoint %s %s: kept as %s; rebuilt %d prepared claim(s) from their directories (%s)",
                  self.checkpoint.path, problem, aside, len(body.claims),
                  ", ".join(sorted(e.claim for e in body.claims.values())) or "none")
        self.checkpoint.write(body)
        return body

    def _rebuild(self) -> Body:
        """The prepared claims, from each claim directory's own record of its finished prepare."""
        body = Body(boot_id=self.boot)
        for directory in self.preparation.dirs.all():
            if not is_kube_claim(directory.claim):
                continue
            try:
                entry = claim_decoder.decode(directory.kubelet_record.read_bytes())
            except FileNotFoundError:
                log.warning("the prepare of %s never finished: removing its directory", directory.claim)
                self.preparation.remove(directory.claim)
                continue
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                # Unknown, not unused: left as found; a prepare makes it again, an unprepare removes it.
                log.error("the prepare record of %s is unreadable (%s): left as it is", directory.claim, exc)
                continue
            if entry.boot_id != self.boot:
                log.warning("%s was prepared in boot %s, this is boot %s: removing it", directory.claim,
                            entry.boot_id or "unknown", self.boot)
                self.preparation.remove(directory.claim)
                continue
            body.claims[entry.uid] = entry
        return body

    def repaired(self) -> tuple[Body | None, str]:
        """``load`` for a call of the kubelet: the body, or None and why it could not be had."""
        try:
            return self.load(), ""
        except OSError as exc:
            error = f"the checkpoint {self.checkpoint.path} could not be repaired: {exc}"
            log.error("%s", error)
            return None, error

    async def restore(self) -> Body:
        """At start: repair the checkpoint before the kubelet can call."""
        async with self.locked():
            body = self.load()
        log.info("kubelet plugin: %d claim(s) prepared in this boot (%s)", len(body.claims),
                 ", ".join(sorted(f"{e.namespace}/{e.name}" for e in body.claims.values())) or "none")
        return body

    # --- prepare --------------------------------------------------------------------------------

    async def prepare(self, refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        results: dict[str, PrepareResult] = {}
        async with self.locked():
            body, error = self.repaired()
            if body is None:
                return {ref.uid: PrepareResult([], error) for ref in refs}
            for ref in refs:
                try:
                    results[ref.uid] = await self._prepare_one(body, ref)
                except Exception as exc:  # one claim's surprise is its own error, not the batch's
                    log.exception("preparing ResourceClaim %s failed", ref)
                    results[ref.uid] = PrepareResult([], f"preparing ResourceClaim {ref} failed: {exc!r}")
        return results

    async def _prepare_one(self, body: Body, ref: ClaimRef) -> PrepareResult:
        try:
            claim = claim_id(ref.uid)
        except ValueError as exc:
            return PrepareResult([], str(exc))
        done = body.claims.get(ref.uid)
        if done is not None and done.state == "prepared" and self.preparation.present(claim):
            return PrepareResult(done.devices)
        if self.broken:  # what is prepared is still answered (above); nothing new can be recorded
            return PrepareResult([], self.broken)
        for field, value, rule in (("namespace", ref.namespace, _NAMESPACE), ("name", ref.name, _NAME)):
            if not rule.match(value):
                return PrepareResult([], f"the kubelet named claim {ref.uid} with claim {field} {value!r}, which "
                                         f"is not a valid ResourceClaim {field}: nothing was read or prepared")
        try:
            obj = await self.reader.get(ref.namespace, ref.name)
        except TemporaryError as exc:
            return PrepareResult([], f"{exc}; the kubelet asks again")
        if obj is None:
            return PrepareResult([], f"ResourceClaim {ref} (uid {ref.uid}) does not exist in the API server")
        try:
            ledger, _ = await self.ledger.read_node(self.node)
        except Exception as exc:
            return PrepareResult([], f"the ledger of node {self.node} could not be read ({exc!r}); the kubelet asks again")
        try:
            devices = allocation.check(obj, uid=ref.uid, node=self.node, entry=ledger.entries.get(claim))
        except allocation.AllocationMismatch as exc:
            return PrepareResult([], str(exc))
        record, _ = await self.claims.get(claim)
        trace = {"traceparent": record.traceparent} if record is not None and record.traceparent else None
        with self.span("enforcer kubelet prepare", parent_headers=trace,
                       attributes={**claim_attributes(record), CLAIM: claim, NODE: self.node,
                                   "k8s.resourceclaim": str(ref)}):
            return await self._make(body, ref, claim, devices, record)

    async def _make(self, body: Body, ref: ClaimRef, claim: str, devices: list[allocation.AllocatedDevice],
                    record: ClaimRecord | None) -> PrepareResult:
        entry = CheckpointClaim(uid=ref.uid, namespace=ref.namespace, name=ref.name, claim=claim, state="preparing",
                                boot_id=self.boot)
        body.claims[ref.uid] = entry
        try:
            self.checkpoint.write(body)
        except OSError as exc:
            del body.claims[ref.uid]
            return PrepareResult([], f"the checkpoint {self.checkpoint.path} could not be written ({exc}): "
                                     f"ResourceClaim {ref} was not prepared")
        try:
            prepared = self.preparation.materialize(
                claim, [d.share for d in devices], await self.inventory(),
                task_priority=record.spec.task_priority if record is not None else None)
            # Each request's CDI device carries all of the request's GPUs (a claim of one request:
            # the claim's one device): named on its first device only, so a container gets its edits
            # once. The kubelet gives a container the CDI ids of the devices whose request names
            # include the request its claim entry names (all of them where it names none).
            named: set[str] = set()
            entry.devices = []
            for d in devices:
                first = d.share.request not in named
                named.add(d.share.request)
                entry.devices.append(CheckpointDevice(
                    request_names=[d.request], pool=d.pool, device=d.device,
                    cdi_ids=[prepared.cdi_device_of(d.share.request)] if first else [], share_id=d.share_id))
            entry.state = "prepared"
            write_atomically(prepared.directory.kubelet_record, msgspec.json.encode(entry))
            self.checkpoint.write(body)
        except Exception as exc:  # whatever stopped it, nothing half-made stays behind
            log.error("preparing ResourceClaim %s failed, rolling it back: %r", ref, exc)
            self.preparation.remove(claim)
            del body.claims[ref.uid]
            with contextlib.suppress(OSError):
                self.checkpoint.write(body)
            return PrepareResult([], f"preparing ResourceClaim {ref} failed and was rolled back: {exc}")
        log.info("prepared ResourceClaim %s (%s) for the kubelet: %s", ref, claim,
                 ", ".join(f"{d.device}:{d.share.memory_mib}MiB/{d.share.cores}%" for d in devices))
        await self._announce(record, prepared)
        return PrepareResult(entry.devices)

    async def _announce(self, record: ClaimRecord | None, prepared: Prepared) -> None:
        """The claim's lifecycle moves to ``prepared`` as on the bus path; the kubelet's answer does not
        wait on it (a failure here leaves the record ``allocated``, which the release path handles)."""
        try:
            if record is not None and record.state == "allocated" and record.node == self.node:
                await self.announce(record, prepared)
        except Exception as exc:
            log.warning("prepared %s, but could not record it as prepared: %r", prepared.claim, exc)

    # --- unprepare ------------------------------------------------------------------------------

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, str]:
        """Per uid, the error ("" = unprepared, or was not prepared)."""
        errors: dict[str, str] = {}
        async with self.locked():
            body, _ = self.repaired()  # without it, the claims' files can still be removed by name
            for ref in refs:
                try:
                    claim = claim_id(ref.uid)
                except ValueError as exc:
                    errors[ref.uid] = str(exc)
                    continue
                present = self.preparation.dirs.of(claim).exists()
                try:
                    self.preparation.remove(claim)
                    if body is not None and body.claims.pop(ref.uid, None) is not None and not self.broken:
                        self.checkpoint.write(body)
                except OSError as exc:
                    errors[ref.uid] = f"unpreparing ResourceClaim {ref} failed: {exc}"
                    continue
                errors[ref.uid] = ""
                if present:
                    log.info("unprepared ResourceClaim %s (%s)", ref, claim)
        return errors
