"""A node's GPUs as a DRA ResourceSlice (``resource.k8s.io/v1``) with consumable capacity (KEP-5075).

On Kubernetes a driver's devices exist for the cluster only as it publishes them in ResourceSlices:
they are what users and their CEL selectors see, and what kube-scheduler's own DRA allocator would
allocate from for a claim Tessera's placement (the allocator of these devices) did not allocate.
The translator's ResourceClaims (`tessera.translator.dra`) ask the device class ``gpu.tessera.dev``
for GPUs and, per GPU, for ``memory`` and ``cores``; this module is the other half of that contract:

- one slice per node, one pool per node (named after the node, one slice in it), driver
  ``gpu.tessera.dev``, ``nodeName`` set: the devices are local to that node;
- one device per healthy GPU, named ``gpu-<index>``, with ``allowMultipleAllocations: true`` so
  that several claims can share it, and the attributes DRA users select on: ``model`` (what the
  translator's CEL matches HAMi's GPU types against) and ``productName`` (the same name, under the
  name NVIDIA's DRA driver uses), ``uuid``, ``index``, and where discovery knows them
  ``architecture``, ``cudaComputeCapability`` and ``driverVersion`` (versions: semver, so CEL can
  compare them with ``isGreaterThan``) and ``pciBusID``;
- capacities ``memory`` (the card's MiB as a quantity; any whole number of MiB from 1Mi, and the
  whole card by default, so a claim that asks for no memory takes the whole card, as HAMi's "no
  gpumem" does), ``cores`` (``100``: any whole percent, the whole card by default; 0 is HAMi's "no
  SM limit") and ``shares`` (the GPU's share limit, HAMi's deviceSplitCount; every allocation
  takes one by default and can take only one), so that any allocation from the slice keeps to
  the same limits as Tessera's own placement.

A sick GPU (one its node's inventory marks unhealthy: NVML lost it or says it fails, or the
simulated profile says so) stays in the slice with a DRA device taint (KEP-5055, ``DRADeviceTaints``:
beta and on from 1.36) ``gpu.tessera.dev/unhealthy``, effect ``NoSchedule``: no allocator gives
it to a new claim (kube-scheduler's skips it unless a claim tolerates the taint; Tessera's placement
allocates no unhealthy GPU), while users still see it, and why, where it was. Not ``NoExecute``:
kube-controller-manager would then delete every pod on the GPU at its first failed check; a pod
sees its GPU's health in its status (the kubelet's dra-health stream) and its owner decides. Where
the API server drops taints (the gate off) the sick GPU is left out instead (`tessera.capacity.kube`).
When the devices change (a taint included) the pool's generation goes up, as DRA asks of a driver
that republishes a pool.

Pure: returns plain dicts; the writer is `tessera.capacity.kube`.
"""

from __future__ import annotations

import re

from tessera.shared.events import GpuDevice, NodeInventory
from tessera.shared.kubeclaims import DRIVER, RESOURCE_API_VERSION, device_name, pool_name

API_VERSION = RESOURCE_API_VERSION
MANAGED_BY = "tessera-capacity"
# Labels on every slice this publisher writes: what its watch selects on.
SLICE_LABELS = {"app.kubernetes.io/part-of": "tessera", "app.kubernetes.io/managed-by": MANAGED_BY}
MAX_STRING = 64  # DRA's limit on a string or version attribute value
TAINT_KEY = f"{DRIVER}/unhealthy"
UNHEALTHY = {"key": TAINT_KEY, "effect": "NoSchedule"}  # (the API server adds timeAdded)


def slice_name(node: str) -> str:
    """The slice's object name: the node's name and the driver's, as a DNS subdomain."""
    base = re.sub(r"[^a-z0-9.-]+", "-", node.lower()).strip("-.") or "node"
    return f"{base}-{DRIVER.replace('.', '-')}"[:253]


def semver(version: str) -> str | None:
    """A dotted version as semver 2.0.0 (three numbers, no leading zeros): NVIDIA's driver
    ``580.65.06`` is ``580.65.6``, compute capability ``9.0`` is ``9.0.0``; None if it is no
    version at all (the attribute is then left out rather than refused by the API server)."""
    parts = version.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    return ".".join(str(int(p)) for p in parts + ["0"] * (3 - len(parts)))


def attributes(gpu: GpuDevice) -> dict:
    name = gpu.model[:MAX_STRING]
    attrs: dict = {
        "model": {"string": name},
        "productName": {"string": name},
        "uuid": {"string": gpu.uuid[:MAX_STRING]},
        "index": {"int": gpu.index},
    }
    if gpu.architecture:
        attrs["architecture"] = {"string": gpu.architecture[:MAX_STRING]}
    for key, value in (("cudaComputeCapability", gpu.compute_capability), ("driverVersion", gpu.driver_version)):
        version = semver(value) if value else None
        if version:
            attrs[key] = {"version": version}
    if gpu.pci_bus_id:
        attrs["pciBusID"] = {"string": gpu.pci_bus_id}
    return attrs


def mebibytes(mib: int) -> str:
    """``mib`` MiB as the API server writes the quantity back (its canonical form: the largest
    binary suffix that keeps it whole, so 40960Mi is ``40Gi``), so that comparing the slice read
    back with the one wanted does not see a change that is only spelling."""
    for suffix in ("Mi", "Gi", "Ti", "Pi"):
        if mib % 1024 or suffix == "Pi":
            return f"{mib}{suffix}"
        mib //= 1024
    raise AssertionError("unreachable")


def device(gpu: GpuDevice) -> dict:
    card = mebibytes(gpu.memory_mib)
    return {
        "name": device_name(gpu.index),
        "attributes": attributes(gpu),
        "capacity": {
            "memory": {"value": card, "requestPolicy": {"default": card, "validRange": {"min": "1Mi", "step": "1Mi"}}},
            "cores": {"value": "100", "requestPolicy": {"default": "100",
                                                        "validRange": {"min": "0", "max": "100", "step": "1"}}},
            "shares": {"value": str(gpu.max_shares), "requestPolicy": {"default": "1", "validValues": ["1"]}},
        },
        "allowMultipleAllocations": True,
    }


def devices(inv: NodeInventory, taints: bool = True) -> list[dict]:
    """The slice's devices: each GPU, a sick one tainted; with ``taints`` False (the API server
    would drop them) a sick one left out."""
    out = []
    for gpu in sorted(inv.devices, key=lambda g: g.index):
        if gpu.healthy:
            out.append(device(gpu))
        elif taints:
            out.append({**device(gpu), "taints": [dict(UNHEALTHY)]})
    return out


def untimed(spec_devices: list[dict] | None) -> list[dict] | None:
    """A slice's devices as read back, less the ``timeAdded`` the API server puts on each taint (so
    that they compare equal to the devices written, which leave it to the server)."""
    if spec_devices is None:
        return None
    return [{**d, "taints": [{k: v for k, v in t.items() if k != "timeAdded"} for t in d["taints"]]}
            if d.get("taints") else d for d in spec_devices]


def resource_slice(inv: NodeInventory, generation: int, node_uid: str | None = None, taints: bool = True) -> dict:
    """The node's ResourceSlice at pool ``generation``; owned by the Node when its uid is given (the
    slice then goes when the Node is deleted)."""
    metadata: dict = {"name": slice_name(inv.node), "labels": dict(SLICE_LABELS)}
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
            "pool": {"name": pool_name(inv.node), "generation": generation, "resourceSliceCount": 1},
            "devices": devices(inv, taints),
        },
    }
