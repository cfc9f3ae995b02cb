"""What the enforcer sees on its node at one instant: the input of usage, reclaim and metrics.

One pass reads the node's ledger entry, its inventory record, every claim directory, each claim's
record, owner lock and accounting file. Everything downstream (usage events, leak decisions, the
Prometheus endpoint) works from this one snapshot, so they never disagree with each other, and none
of them needs memory that a restart would lose: the next pass rebuilds it from disk and KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import msgspec

from tessera.shared.claimstore import ClaimStore
from tessera.shared.events import ClaimRecord, GpuDevice, NodeInventory, NodeLedger
from tessera.shared.ledger import Ledger
from tessera.shared.lifecycle import ON_NODE

from tessera.enforcer import accounting
from tessera.enforcer.claimdir import ClaimDir, ClaimDirs
from tessera.enforcer.processes import owner_alive

log = logging.getLogger("tessera.enforcer.observe")

_inventory = msgspec.json.Decoder(NodeInventory)


@dataclass
class ClaimView:
    claim: str
    record: ClaimRecord | None  # None: no record in the claims bucket
    directory: ClaimDir | None  # None: in the ledger but never prepared here
    owner: bool = False
    snapshot: accounting.VgpuSnapshot = accounting.EMPTY
    in_ledger: bool = False
    error: str = ""  # the accounting file could not be read

    @property
    def live(self) -> bool:
        """Allocated to this node and not yet released."""
        return self.record is not None and self.record.state in ON_NODE

    @property
    def processes(self) -> tuple[accounting.ProcessUsage, ...]:
        return self.snapshot.live_processes


@dataclass
class NodeView:
    node: str
    devices: dict[str, GpuDevice] = field(default_factory=dict)  # uuid -> device
    labels: dict[str, str] = field(default_factory=dict)
    ledger: NodeLedger | None = None
    claims: dict[str, ClaimView] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)


class Observer:
    def __init__(self, node: str, dirs: ClaimDirs, claims: ClaimStore, ledger: Ledger, inventory_kv) -> None:
        self.node = node
        self.dirs = dirs
        self.claims = claims
        self.ledger = ledger
        self.inventory_kv = inventory_kv
        self.devices: dict[str, GpuDevice] = {}
        self.labels: dict[str, str] = {}
        self.unreadable: dict[str, str] = {}  # claim -> why its accounting file was not read, last pass

    async def inventory(self) -> None:
        try:
            entry = await self.inventory_kv.get(self.node)
        except Exception:  # not announced yet: keep what we knew
            return
        if entry.value:
            try:
                inv = _inventory.decode(entry.value)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                log.error("inventory record of %s is unreadable: %s", self.node, exc)
                return
            self.devices = {d.uuid: d for d in inv.devices}
            self.labels = dict(inv.labels)

    async def observe(self) -> NodeView:
        await self.inventory()
        ledger, _ = await self.ledger.read_node(self.node)
        view = NodeView(node=self.node, devices=dict(self.devices), labels=dict(self.labels), ledger=ledger)
        names = {d.claim: d for d in self.dirs.all()}
        for claim in sorted(set(names) | set(ledger.entries)):
            record, _ = await self.claims.get(claim)
            view.claims[claim] = ClaimView(
                claim=claim, record=record, directory=names.get(claim), in_ledger=claim in ledger.entries
            )
        await asyncio.to_thread(self._read_files, list(view.claims.values()))
        return view

    async def look(self, claim: str) -> ClaimView:
        """One claim as the next pass would see it (its record read now), between passes."""
        record, _ = await self.claims.get(claim)
        directory = self.dirs.of(claim)
        cv = ClaimView(claim=claim, record=record, directory=directory if directory.path.is_dir() else None)
        await asyncio.to_thread(self._read_files, [cv], False)
        return cv

    def _read_files(self, views: list[ClaimView], whole_pass: bool = True) -> None:
        unreadable: dict[str, str] = {}
        for cv in views:
            if cv.directory is None:
                continue
            cv.owner = owner_alive(cv.directory.owner_lock)
            try:
                cv.snapshot = _read_claim(cv.directory)
            except (accounting.VgpuCacheError, OSError) as exc:
                cv.error = unreadable[cv.claim] = str(exc)
                # Unreadable is not idle: keep it looking used so nothing is released on a guess.
                cv.snapshot = accounting.EMPTY
                if self.unreadable.get(cv.claim) != cv.error:  # once per condition, not every pass
                    held = isinstance(exc, accounting.VgpuCacheLocked)
                    log.warning("claim %s: accounting file %s: %s", cv.claim,
                                "lock held too long, not waited for" if held else "unreadable", exc)
        if not whole_pass:
            return
        for claim in set(self.unreadable) - set(unreadable):
            log.info("claim %s: accounting file readable again", claim)
        self.unreadable = unreadable



def _read_claim(directory: ClaimDir) -> accounting.VgpuSnapshot:
    """The claim's accounting: its own file, or for a claim of several requests (a pod's GPU
    containers) each request's, their devices and processes taken together."""
    requests = directory.requests()
    if not requests:
        return accounting.read(directory.cache)
    snapshots = [accounting.read(r.cache) for r in requests]
    return dataclasses.replace(snapshots[0], devices=tuple(d for s in snapshots for d in s.devices),
                               processes=tuple(p for s in snapshots for p in s.processes))
