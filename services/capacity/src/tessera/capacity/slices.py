"""A node's GPUs as a DRA ResourceSlice (``resource.k8s.io/v1``) with consumable capacity (KEP-5075).

On Kubernetes the scheduler's DRA allocator only allocates what a driver publishes in ResourceSlices.
The translator's ResourceClaims (`tessera.translator.dra`) ask the device class ``gpu.tessera.dev``
for GPUs and, per GPU, for ``memory`` and ``cores``; this module is the other half of that contract:

- one slice per node, one pool per node (named after the node, one slice in it), driver
  ``gpu.tessera.dev``, ``nodeName`` set: the devices are local to that node;
- one device per healthy GPU, named ``gpu-<index>``, with attributes ``model``, ``uuid`` and
  ``index``, and ``allowMultipleAllocations: true`` so that several claims can share it;
- capacities ``memory`` (the card's MiB as a quantity; no request policy, so a claim that asks for
  no memory takes the whole card, as HAMi's "no gpumem" does), ``cores`` (``100``) and ``shares``
  (the GPU's share limit, HAMi's deviceSplitCount; every allocation takes one by default and can
  take only one), so that the allocator keeps to the same limits as Tessera's own placement.

A sick GPU is left out (nothing should be allocated on it); when the set of devices changes the
pool's generation goes up, as DRA asks of a driver that republishes a pool.

Pure: returns plain dicts; the writer is `tessera.capacity.kube`.
"""

from __future__ import annotations

import re

from tessera.shared.events import GpuDevice, NodeInventory

DRIVER = "gpu.tessera.dev"
API_VERSION = "resource.k8s.io/v1"


def slice_name(node: str) -> str:
    """The slice's object name: the node's name and the driver's, as a DNS subdomain."""
    base = re.sub(r"[^a-z0-9.-]+", "-", node.lower()).strip("-.") or "node"
    return f"{base}-{DRIVER.replace('.', '-')}"[:253]


def device(gpu: GpuDevice) -> dict:
    return {
        "name": f"gpu-{gpu.index}",
        "attributes": {
            "model": {"string": gpu.model},
            "uuid": {"string": gpu.uuid},
            "index": {"int": gpu.index},
        },
        "capacity": {
            "memory": {"value": f"{gpu.memory_mib}Mi"},
            "cores": {"value": "100"},
            "shares": {"value": str(gpu.max_shares), "requestPolicy": {"default": "1", "validValues": ["1"]}},
        },
        "allowMultipleAllocations": True,
    }


def devices(inv: NodeInventory) -> list[dict]:
    return [device(g) for g in sorted(inv.devices, key=lambda g: g.index) if g.healthy]


def resource_slice(inv: NodeInventory, generation: int, node_uid: str | None = None) -> dict:
    """The node's ResourceSlice at pool ``generation``; owned by the Node when its uid is given (the
    slice then goes when the Node is deleted)."""
    metadata: dict = {"name": slice_name(inv.node), "labels": {"app.kubernetes.io/part-of": "tessera",
                                                                "app.kubernetes.io/managed-by": "tessera-capacity"}}
    if node_uid:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": inv.node, "uid": node_uid,
                                        "controller": True}]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": DRIVER,
            "nodeName": inv.node,
            "pool": {"name": inv.node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices(inv),
        },
    }
