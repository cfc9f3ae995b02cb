"""Kubernetes mode of the capacity publisher: it keeps each node's DRA ResourceSlice true.

Applied with server-side apply under the field manager ``tessera-capacity``. Slices do not stay as
written: the kubelet deletes every ResourceSlice of its node when it starts (and a person or
another controller may edit one), so the publisher compares what the API server holds with what it
would write — at each heartbeat with one list of its own slices, and as soon as a watch on them
reports a change — and re-applies what differs.

The pool generation goes up only when the devices change: a slice re-applied with the same devices
(after a kubelet wiped it, or someone edited it) keeps the generation last written, so DRA
consumers do not see a new pool for nothing; a restarted publisher reads the generation back from
the slice already there and neither rewinds it nor bumps it. The slice is owned by its Node object
where one exists (a simulated node has none), so deleting the Node deletes its slice.

A sick GPU's device taint (slices.py) is compared without the ``timeAdded`` the API server gives it,
and a re-apply carries that time over, so a taint keeps the time it was first written. An API server
that drops taints (``DRADeviceTaints`` off) is told from the slice it answers: the writer says so
once, naming the gate, and from then on leaves sick GPUs out of its slices.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Iterable

from tessera.shared.events import NodeInventory
from tessera.shared.featuregates import DEVICE_TAINTS, require_consumable_capacity, taints_dropped
from tessera.shared.kubeapi import KubeApi, object_path

from tessera.capacity.slices import API_VERSION, DRIVER, SLICE_LABELS, devices, resource_slice, slice_name, untimed

log = logging.getLogger("tessera.capacity.kube")

FIELD_MANAGER = "tessera-capacity"
COLLECTION = object_path(API_VERSION, "resourceslices")
LABEL_SELECTOR = ",".join(f"{k}={v}" for k, v in sorted(SLICE_LABELS.items()))
_MISSING = object()  # "not read yet" (None means "read: there is none")


def field_selector(nodes: Iterable[str]) -> str:
    """The slices of this driver, and of the one node when the publisher serves only one (the
    DaemonSet's case: it then never hears of other nodes' slices)."""
    nodes = sorted(set(nodes))
    selector = f"spec.driver={DRIVER}"
    return selector + (f",spec.nodeName={nodes[0]}" if len(nodes) == 1 else "")


def _keep_taint_times(body: dict, current: dict | None) -> None:
    """Give each taint of ``body`` the ``timeAdded`` the same taint of the same device has in
    ``current`` (a re-apply that left it out would have the server stamp it anew)."""
    held = {(d.get("name"), t.get("key"), t.get("effect")): t["timeAdded"]
            for d in ((current or {}).get("spec") or {}).get("devices") or []
            for t in d.get("taints") or [] if t.get("timeAdded")}
    for d in body["spec"]["devices"]:
        for t in d.get("taints") or []:
            since = held.get((d["name"], t["key"], t["effect"]))
            if since:
                t["timeAdded"] = since


def says(current: dict | None, wanted: dict) -> bool:
    """Whether the slice the API server holds says what ``wanted`` says (its spec and our labels)."""
    if current is None:
        return False
    labels = (current.get("metadata") or {}).get("labels") or {}
    spec = current.get("spec") or {}
    return {**spec, "devices": untimed(spec.get("devices"))} == wanted["spec"] and all(labels.get(k) == v for k, v in SLICE_LABELS.items())


class SliceWriter:
    def __init__(self, api: KubeApi | None = None) -> None:
        self.api = api or KubeApi()
        # node -> (pool generation, devices) last written: what a re-apply restores.
        self.written: dict[str, tuple[int, list[dict]]] = {}
        self.taints = True  # False once the API server is seen dropping device taints

    async def publish(self, inv: NodeInventory, current=_MISSING) -> int | None:
        """Make the node's slice say what ``inv`` says: the pool generation written, or None when
        the slice already said it. ``current`` is the slice as just read (None: there is none)."""
        path = object_path(API_VERSION, "resourceslices", slice_name(inv.node))
        if current is _MISSING:
            current = await self.api.get(path)
        want = devices(inv, self.taints)
        spec = (current or {}).get("spec") or {}
        held = int((spec.get("pool") or {}).get("generation") or 0)
        last = self.written.get(inv.node)
        before = last[1] if last else untimed(spec.get("devices")) if current is not None else None
        generation = max(last[0] if last else 0, held)
        if before != want or generation == 0:
            generation += 1
        wanted = resource_slice(inv, generation, taints=self.taints)
        if says(current, wanted):
            self.written[inv.node] = (generation, want)
            return None
        node = await self.api.get(object_path("v1", "nodes", inv.node))
        uid = ((node or {}).get("metadata") or {}).get("uid")
        body = resource_slice(inv, generation, uid, taints=self.taints)
        _keep_taint_times(body, current)
        stored = await self.api.apply(path, COLLECTION, body, FIELD_MANAGER)
        # a server without consumable capacity keeps the slice but drops what lets GPUs be shared
        require_consumable_capacity(f"ResourceSlice {slice_name(inv.node)}", body, stored)
        if taints_dropped(body, stored):
            self.taints = False
            log.warning("the API server dropped the device taints of ResourceSlice %s: the %s feature gate is off "
                        "there (kube-apiserver, kube-scheduler, kube-controller-manager: --feature-gates=%s=true; "
                        "on by default from 1.36). Unhealthy GPUs are left out of the slices instead",
                        slice_name(inv.node), DEVICE_TAINTS, DEVICE_TAINTS)
            self.written.pop(inv.node, None)
            return await self.publish(inv, stored)
        self.written[inv.node] = (generation, want)
        why = "written" if current is None else "re-applied"
        log.info("ResourceSlice %s %s: %d GPUs, pool generation %d", slice_name(inv.node), why, len(want), generation)
        return generation

    async def read(self, nodes: Iterable[str]) -> dict[str | None, dict]:
        """Our slices of ``nodes`` as the API server holds them (slice name -> object), in one list.
        (Keyed by what metadata.name holds: None for an object without one, which no server lists.)"""
        items, _ = await self.api.list(COLLECTION, LABEL_SELECTOR, field_selector(nodes))
        return {(o.get("metadata") or {}).get("name"): o for o in items}

    async def watch(self, nodes: Iterable[str], on_change: Callable[[str], Awaitable[None]]) -> None:
        """Forever: tell ``on_change`` the node whose slice was deleted or changed by anyone else.

        (An edit that takes our labels off a slice reaches this label-selected watch as a DELETED.)"""
        nodes = list(nodes)
        by_slice: dict[str | None, str] = {slice_name(n): n for n in nodes}  # (looked up by metadata.name)
        while True:
            try:
                async for kind, obj in self.api.watch(COLLECTION, label_selector=LABEL_SELECTOR,
                                                      field_selector=field_selector(nodes)):
                    node = by_slice.get((obj.get("metadata") or {}).get("name"))
                    if node is not None and (kind == "DELETED" or not self._as_written(node, obj)):
                        await on_change(node)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # refused (RBAC, say): the heartbeat still checks; try again later
                log.warning("ResourceSlice watch failed (%s); the heartbeat checks the slices meanwhile", exc)
                await asyncio.sleep(30)

    def _as_written(self, node: str, obj: dict) -> bool:
        last = self.written.get(node)
        spec = obj.get("spec") or {}
        return last is not None and untimed(spec.get("devices")) == last[1] and \
            (spec.get("pool") or {}).get("generation") == last[0] and spec.get("nodeName") == node

    async def close(self) -> None:
        await self.api.close()
