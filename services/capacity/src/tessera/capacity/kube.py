"""Kubernetes mode of the capacity publisher: it keeps each node's DRA ResourceSlice current.

Applied with server-side apply under the field manager ``tessera-capacity``. The pool generation is
read back from the slice already there and raised only when the devices changed, so a restarted
publisher neither rewinds it nor bumps it for nothing. The slice is owned by its Node object where
one exists (a simulated node has none), so deleting the Node deletes its slice.
"""

from __future__ import annotations

import logging

from tessera.shared.events import NodeInventory
from tessera.shared.kubeapi import KubeApi, object_path

from tessera.capacity.slices import API_VERSION, devices, resource_slice, slice_name

log = logging.getLogger("tessera.capacity.kube")

FIELD_MANAGER = "tessera-capacity"
COLLECTION = object_path(API_VERSION, "resourceslices")


class SliceWriter:
    def __init__(self, api: KubeApi | None = None) -> None:
        self.api = api or KubeApi()

    async def publish(self, inv: NodeInventory) -> int | None:
        """Make the node's slice say what ``inv`` says: the pool generation written, or None when
        the slice already said it."""
        path = object_path(API_VERSION, "resourceslices", slice_name(inv.node))
        current = await self.api.get(path)
        spec = (current or {}).get("spec") or {}
        pool = spec.get("pool") or {}
        if current is not None and pool.get("name") == inv.node and spec.get("devices") == devices(inv):
            return None
        generation = int(pool.get("generation") or 0) + 1
        node = await self.api.get(object_path("v1", "nodes", inv.node))
        uid = ((node or {}).get("metadata") or {}).get("uid")
        await self.api.apply(path, COLLECTION, resource_slice(inv, generation, uid), FIELD_MANAGER)
        log.info("ResourceSlice %s: %d GPUs, pool generation %d", slice_name(inv.node), len(devices(inv)), generation)
        return generation

    async def close(self) -> None:
        await self.api.close()
