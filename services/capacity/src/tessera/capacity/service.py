"""The capacity publisher: announces each node's GPUs, keeps them alive, notices nodes going silent.

For every node it serves (all nodes of a simulated profile, or the one real node it runs on) it
writes the inventory to the ``inventory`` bucket and publishes it on ``tessera.inventory.<node>``,
then publishes a heartbeat every ``TESSERA_HEARTBEAT_SECONDS``. Every publisher also watches all
heartbeats: a node silent for ``TESSERA_LOST_AFTER_SECONDS`` is marked lost (label
``tessera.dev/lost=true`` in its inventory record, and a ``lost`` event), so placement stops using it
and the enforcers' leak reclaim can release what it held. A node whose enforcer reported usage
before and then fell silent for ``TESSERA_ENFORCER_LOST_AFTER_SECONDS`` is lost as well (its GPUs are
announced, but nothing there can prepare or release a claim). A node is restored when both speak
again. On Kubernetes (``TESSERA_KUBERNETES=true``) it also keeps each node's DRA ResourceSlice
true (`tessera.capacity.slices`, `tessera.capacity.kube`): at every heartbeat it lists its slices
and re-applies any that is missing (the kubelet deletes a node's slices when it starts) or says
something else, and a watch on them does the same as soon as one changes; an API server that cannot
be reached is retried at the next heartbeat, and NATS goes on meanwhile. While a node it serves is
lost (its enforcer silent) the slice shows no devices, so nothing on Kubernetes offers GPUs there
either (placement already allocates none on a lost node). A node's slice is written only while the
kubelet has the node's DRA plugin registered, as its enforcer says (`tessera.capacity.plugins`): the
kubelet deletes the slices of a plugin that went, and they stay gone until it is back. At every
heartbeat each GPU's health is read again (`tessera.capacity.health`); a change is announced as a
new inventory (placement allocates nothing on an unhealthy GPU) and shows in the slice as a device
taint (`tessera.capacity.slices`), gone again when the GPU recovers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import msgspec

from tessera.capacity.metrics import CapacityMetrics
from tessera.shared import subjects
from tessera.shared.bus import Outgoing
from tessera.shared.events import (
    KubeletPluginStatus,
    NodeHeartbeat,
    NodeInventory,
    NodeLost,
    NodeUsage,
    encode,
    inventory_decoder,
    usage_decoder,
)
from tessera.shared.featuregates import FeatureGateOff
from tessera.shared.kvkeys import live_keys
from tessera.shared.runner import ServiceContext
from tessera.shared.telemetry import NODE, decided

from tessera.shared.inventory import is_lost, with_lost

from tessera.capacity.discovery import discover
from tessera.capacity.health import HealthSource
from tessera.capacity.plugins import KubeletPlugins
from tessera.capacity.settings import CapacitySettings
from tessera.capacity.slices import slice_name

log = logging.getLogger("tessera.capacity")

_inventory_record = msgspec.json.Decoder(NodeInventory)


class CapacityService:
    def __init__(self, ctx: ServiceContext, settings: CapacitySettings, nodes: list[NodeInventory],
                 slices=None) -> None:
        self.ctx = ctx
        self.bus = ctx.bus
        self.settings = settings
        self.nodes = nodes
        # Kubernetes mode: the ResourceSlice writer, and the nodes whose slice is not current yet.
        if slices is None and settings.kubernetes:
            from tessera.capacity.kube import SliceWriter

            slices = SliceWriter()
        self.slices = slices
        self.slices_due: set[str] = {n.node for n in nodes} if slices is not None else set()
        self._slices_lock = asyncio.Lock()  # one pass over the slices at a time (heartbeat, watch, lost)
        # What each served node's slice should say now: its GPUs, or none while the node is lost.
        self.slice_view: dict[str, NodeInventory] = {n.node: n for n in nodes}
        self.last_seen: dict[str, float] = {}
        self.enforcer_seen: dict[str, float] = {}
        self.lost: set[str] = set()
        # Kubernetes mode: whose kubelet plugin is registered (their slices are written), and the
        # nodes whose slice is held back now (said once per change).
        self.plugins = KubeletPlugins(settings.plugin_silent_after_seconds)
        self.held_back: set[str] = set()
        self.health = HealthSource(settings)
        self.generation = 0  # of the inventories last announced

    async def start(self) -> dict:
        self.kv = await self.bus.kv(subjects.KV_INVENTORY)
        self.ctx.metrics.add(CapacityMetrics(self))
        announced = self.ctx.gate("announced")
        watching = self.ctx.gate("watching")  # the peers' heartbeats, once the nodes known are read
        tasks = {
            "announce-and-heartbeat": self._heartbeats(announced),
            "watch-heartbeats": self._watch_heartbeats(watching),
            "watch-enforcers": self._watch_enforcers(),
            "detect-lost": self._detect_lost(),
        }
        if self.slices is not None:
            tasks["watch-slices"] = self.slices.watch([n.node for n in self.nodes], self._slice_changed)
        return tasks

    async def _slice_changed(self, node: str) -> None:
        """The watch saw a node's slice deleted or edited: put it back now, not at the next beat."""
        self.slices_due.add(node)
        await self._publish_slices()

    def silent(self, node: str, now: float) -> str | None:
        """Why ``node`` counts as lost now (None: it does not)."""
        seen = self.last_seen.get(node)
        if seen is not None and seen < now - self.settings.lost_after_seconds:
            return f"no heartbeat for {now - seen:.0f}s"
        enforcer = self.enforcer_seen.get(node)
        if enforcer is not None and enforcer < now - self.settings.enforcer_lost_after_seconds:
            return f"its enforcer has been silent for {now - enforcer:.0f}s"
        return None

    async def _watch_enforcers(self) -> None:
        """Node usage reports are the enforcers' sign of life; their kubelet plugin's status decides
        whether the node's slice is written."""
        async def reported(event, _headers) -> None:
            if isinstance(event, NodeUsage):
                await self._sign_of_life(self.enforcer_seen, event.node)
            elif isinstance(event, KubeletPluginStatus):
                await self._plugin_said(event)

        await self.bus.follow(f"{subjects.USAGE}.>", usage_decoder, reported)

    async def _plugin_said(self, status: KubeletPluginStatus) -> None:
        node = status.node
        before = self.plugins.registered(node, time.time())
        self.plugins.heard(status, time.time())
        if self.slices is None or node not in self.slice_view or self.plugins.registered(node, time.time()) == before:
            return
        if before:
            log.info("the kubelet plugin of %s is not registered (%s): its ResourceSlice is left to the kubelet, "
                     "which deletes it", node, status.reason)
            return
        self.slices_due.add(node)  # registered (again): the slice the kubelet deleted comes back now
        await self._publish_slices()

    def writable(self, node: str) -> bool:
        """Whether ``node``'s slice may be written now (said once each time that changes)."""
        why = None if not self.settings.slices_need_plugin else self.plugins.why_not(node, time.time())
        if why is None:
            if node in self.held_back:
                self.held_back.discard(node)
                log.info("ResourceSlice of %s written again: its kubelet plugin is registered", node)
            return True
        if node not in self.held_back:
            self.held_back.add(node)
            log.info("ResourceSlice of %s not written: %s (TESSERA_SLICES_NEED_PLUGIN=false writes it regardless)",
                     node, why)
        return False

    async def _sign_of_life(self, seen: dict[str, float], node: str) -> None:
        """Note it, and give a node that was lost back to placement once nothing of it is silent."""
        seen[node] = time.time()
        if node in self.lost and self.silent(node, time.time()) is None:
            await self._restore(node)

    async def announce(self, inv: NodeInventory) -> None:
        # A capacity publisher handles no claim; its spans are the nodes' (each starts a trace).
        with self.ctx.telemetry.span("capacity announce", attributes={NODE: inv.node}):
            await self.kv.put(inv.node, encode(inv))
            await self.bus.publish(subjects.inventory(inv.node), inv, msg_id=f"{inv.node}:inventory:{inv.generation}")
            decided(inv, "announced", f"{len(inv.devices)} GPUs, generation {inv.generation}", span=None,
                    **{NODE: inv.node})  # (span=None: the current one; named, so the ** is only attributes)

    async def _heartbeats(self, announced) -> None:
        self.generation = int(time.time())
        for inv in self.nodes:
            await self.announce(msgspec.structs.replace(inv, generation=self.generation))
        announced()
        log.info("announced %d nodes, %d GPUs", len(self.nodes), sum(len(n.devices) for n in self.nodes))
        await self._publish_slices()
        seq = 0
        while True:
            await asyncio.sleep(self.settings.heartbeat_seconds)
            seq += 1
            await self._follow_health()
            await self._publish_slices(verify=True)
            try:
                await self.bus.publish_many(
                    Outgoing(subjects.inventory(inv.node), NodeHeartbeat(node=inv.node, seq=seq)) for inv in self.nodes
                )
            except Exception as exc:  # NATS restarting: the next beat goes out once it is back
                log.warning("heartbeat %d not published: %r", seq, exc)

    async def _follow_health(self) -> None:
        """Announce the nodes whose GPUs' health changed since they were last announced."""
        try:
            health = await asyncio.to_thread(self.health.read, [d.uuid for n in self.nodes for d in n.devices])
        except Exception as exc:  # NVML misbehaving: the health last read stands, read again next beat
            log.warning("GPU health not read: %r", exc)
            return
        if health is None:
            return
        for i, inv in enumerate(self.nodes):
            now = [msgspec.structs.replace(d, healthy=health.get(d.uuid, False)) for d in inv.devices]
            if now == inv.devices:
                continue
            inv = msgspec.structs.replace(inv, devices=now)
            self.generation = max(self.generation + 1, int(time.time()))
            labels = with_lost(inv.labels, inv.node in self.lost)
            try:
                await self.announce(msgspec.structs.replace(inv, labels=labels, generation=self.generation))
            except Exception as exc:  # NATS away: tried again at the next heartbeat
                log.warning("inventory of %s not announced: %r", inv.node, exc)
                continue
            self.nodes[i] = inv
            sick = [f"gpu-{d.index}" for d in now if not d.healthy]
            log.warning("GPU health of %s changed: %s", inv.node, f"unhealthy {', '.join(sick)}" if sick else "all healthy")
            if inv.node not in self.lost:
                self.slice_view[inv.node] = inv
                self.slices_due.add(inv.node)

    async def _publish_slices(self, verify: bool = False) -> None:
        """Bring the ResourceSlices not yet current up to date (Kubernetes mode; else nothing).

        ``verify`` (each heartbeat): first list what the API server holds, so that a slice the
        kubelet deleted or someone edited is noticed even if the watch missed it."""
        if self.slices is None:
            return
        async with self._slices_lock:
            listed = None
            if verify:
                try:
                    listed = await self.slices.read(n.node for n in self.nodes)
                    self.slices_due.update(n.node for n in self.nodes)  # each compared with what was listed
                except Exception as exc:
                    log.warning("ResourceSlices not read (checked again at the next heartbeat): %s", exc)
            for served in self.nodes:  # (in the profile's order)
                node = served.node
                if node not in self.slices_due or not self.writable(node):
                    continue
                inv = self.slice_view[node]
                try:
                    if listed is None:
                        await self.slices.publish(inv)
                    else:
                        await self.slices.publish(inv, listed.get(slice_name(node)))
                    self.slices_due.discard(inv.node)
                except FeatureGateOff:
                    raise  # no retry helps: the service stops, saying which gate to turn on
                except Exception as exc:  # API server away or refusing: said once per try, retried next beat
                    log.warning("ResourceSlice of %s not written (retried at the next heartbeat): %s", inv.node, exc)

    async def _watch_heartbeats(self, watching: Callable[[], None]) -> None:
        """Every publisher tracks every node's last sign of life (core subscription, no storage).

        The nodes already announced are read from the bucket *after* the subscription is in place:
        a peer that announces itself between the two is then heard by the subscription, where
        reading first would miss it (not in the bucket yet, and its announcement published before
        anyone listened); such a peer dying before its first heartbeat would never be marked lost."""
        async def known_nodes() -> None:
            now = time.time()
            for key in await live_keys(self.kv):
                self.last_seen.setdefault(key, now)  # grace period for nodes known before we started
            watching()

        async def beat(event, _headers) -> None:
            if isinstance(event, (NodeHeartbeat, NodeInventory)):
                await self._sign_of_life(self.last_seen, event.node)

        await self.bus.follow(f"{subjects.INVENTORY}.>", inventory_decoder, beat, subscribed=known_nodes)

    async def _detect_lost(self) -> None:
        while True:
            await asyncio.sleep(max(0.2, self.settings.heartbeat_seconds / 2))
            now = time.time()
            for node in list(self.last_seen):
                why = self.silent(node, now)
                if why is not None and node not in self.lost:
                    await self._mark_lost(node, self.last_seen[node], why)

    async def _slice_shows(self, node: str, lost: bool) -> None:
        """Kubernetes mode: a lost node we serve shows no devices in its ResourceSlice (no GPU that
        nothing on the node can prepare is offered); back, all of them."""
        served = next((n for n in self.nodes if n.node == node), None)  # (its current health)
        if self.slices is None or served is None:
            return
        self.slice_view[node] = msgspec.structs.replace(served, devices=[]) if lost else served
        self.slices_due.add(node)
        await self._publish_slices()

    async def _mark_lost(self, node: str, seen: float, why: str) -> None:
        """Label the node lost in its inventory record (CAS, so two publishers agree) and say so."""
        self.lost.add(node)
        await self._slice_shows(node, lost=True)
        try:
            entry = await self.kv.get(node)
        except Exception:
            return
        if not entry.value:
            return
        inv = _inventory_record.decode(entry.value)
        if is_lost(inv):
            return
        labels = with_lost(inv.labels, True)
        try:
            await self.kv.update(node, encode(msgspec.structs.replace(inv, labels=labels)), last=entry.revision)
        except Exception:
            return  # another publisher marked it, or it came back; either way not ours to say
        with self.ctx.telemetry.span("capacity node lost", attributes={NODE: node}):
            log.warning("node %s lost: %s", node, why)
            await self.bus.publish(
                subjects.inventory(node),
                NodeLost(node=node, last_seen=seen, reason=why),
                msg_id=f"{node}:lost:{int(time.time())}",
            )
            decided(None, "lost", why, span=None, **{NODE: node})

    async def _restore(self, node: str) -> None:
        self.lost.discard(node)
        await self._slice_shows(node, lost=False)
        try:
            entry = await self.kv.get(node)
        except Exception:
            return
        assert entry.value is not None  # this bucket holds only encoded inventories, never an empty value
        inv = _inventory_record.decode(entry.value)
        if not is_lost(inv):
            return
        labels = with_lost(inv.labels, False)
        try:
            await self.kv.update(node, encode(msgspec.structs.replace(inv, labels=labels)), last=entry.revision)
            log.info("node %s is back", node)
        except Exception:
            pass


async def build(ctx: ServiceContext, settings: CapacitySettings) -> dict:
    return await CapacityService(ctx, settings, discover(settings)).start()
