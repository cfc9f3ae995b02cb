"""The allocation placement writes into a ResourceClaim is valid ``resource.k8s.io/v1``, strictly,
names what the capacity publisher's slices name, and is the same document on every write."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import kubernetes_validate
import pytest

from tessera.shared.events import ClaimSpec, DeviceShare, GpuDevice, NodeInventory
from tessera.shared.kubeclaims import DRIVER

from tessera.capacity.slices import devices as slice_devices
from tessera.placement.claimstatus import allocation, describes, held_shares, node_selector, same_allocation, share_id
from tessera.translator.dra import resource_claim

K8S = "1.35.0"  # what the API-server emulator of tests/kubernetes validates against
CLAIM = "k8s-2f1e0c3a-9d4b-4c3e-8a1f-0b9e8d7c6a51"
H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-40GB"


def claim_with_status(spec: ClaimSpec, status: dict, **kwargs) -> dict:
    claim = resource_claim(spec, "pod-gpu-x7k2p", "team-a", **kwargs)
    claim["metadata"].update(uid=CLAIM[4:], resourceVersion="17")
    claim["status"] = {"allocation": status}
    return claim


def shares(*specs: tuple[int, int, int]) -> list[DeviceShare]:
    return [DeviceShare(uuid=f"GPU-{i}", index=i, memory_mib=m, cores=c) for i, m, c in specs]


def test_allocation_is_strictly_valid_and_matches_the_slices():
    at = datetime(2026, 12, 1, 8, 0, 0, tzinfo=timezone.utc)
    status = allocation(CLAIM, "gpu-1", shares((0, 20000, 30), (3, 20000, 30)), at=at)
    kubernetes_validate.validate(claim_with_status(ClaimSpec(gpus=2, memory_mib=20000, cores=30), status),
                                 K8S, strict=True)

    inventory = NodeInventory(node="gpu-1", devices=[GpuDevice(uuid=f"GPU-{i}", index=i, model=H100,
                                                               memory_mib=81559) for i in range(4)])
    published = {d["name"] for d in slice_devices(inventory)}
    results = status["devices"]["results"]
    assert [(r["request"], r["driver"], r["pool"]) for r in results] == [("gpu", DRIVER, "gpu-1")] * 2
    assert [r["device"] for r in results] == ["gpu-0", "gpu-3"] and {r["device"] for r in results} <= published
    assert results[0]["consumedCapacity"] == {"memory": "20000Mi", "cores": "30", "shares": "1"}
    assert status["nodeSelector"] == node_selector("gpu-1")
    assert status["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["gpu-1"]
    assert status["allocationTimestamp"] == "2026-12-01T08:00:00Z"


def test_share_ids_are_uuids_stable_per_claim_and_device():
    first = allocation(CLAIM, "gpu-0", shares((1, 1000, 10)))
    again = allocation(CLAIM, "gpu-0", shares((1, 1000, 10)), at=datetime(2030, 1, 1, tzinfo=timezone.utc))
    assert same_allocation(first, again)  # a retry writes the same allocation (timestamp aside)
    sid = first["devices"]["results"][0]["shareID"]
    assert str(uuid.UUID(sid)) == sid
    other_claim = "k8s-00000000-0000-4000-8000-000000000001"
    assert share_id(other_claim, "gpu-0", 1) != sid
    assert share_id(CLAIM, "gpu-0", 2) != sid and share_id(CLAIM, "gpu-1", 1) != sid


def test_a_different_allocation_is_not_the_same():
    written = allocation(CLAIM, "gpu-0", shares((1, 1000, 10)))
    assert not same_allocation(written, allocation(CLAIM, "gpu-1", shares((1, 1000, 10))))
    assert not same_allocation(written, allocation(CLAIM, "gpu-0", shares((1, 2000, 10))))
    assert not same_allocation(None, written) and not same_allocation({}, written)
    # What the API server hands back may carry fields it adds: still ours.
    echoed = {**written, "devices": {"results": [dict(r, adminAccess=None) for r in written["devices"]["results"]]}}
    assert same_allocation(echoed, written)


def test_the_server_s_canonical_quantities_are_the_same_allocation():
    """The API server stores 20480Mi as 20Gi: read back, it is still the allocation placement wrote
    (compared as text, a restart or a redelivery would give a running pod's GPU back)."""
    written = allocation(CLAIM, "gpu-0", shares((1, 20480, 10)))
    canonical = {**written, "devices": {"results": [
        dict(r, consumedCapacity={**r["consumedCapacity"], "memory": "20Gi"}) for r in written["devices"]["results"]]}}
    assert same_allocation(canonical, written)
    other = {**written, "devices": {"results": [
        dict(r, consumedCapacity={**r["consumedCapacity"], "memory": "20G"}) for r in written["devices"]["results"]]}}
    assert not same_allocation(other, written)


def test_a_percentage_claim_names_the_subrequest_of_the_allocated_model():
    spec = ClaimSpec(memory_percent=50, cores=20)
    claim = resource_claim(spec, "pod-gpu-x7k2p", "team-a", card_memory_mib={H100: 81559, A100: 40960})
    status = allocation(CLAIM, "gpu-1", shares((2, 20480, 20)), claim_spec=claim["spec"], models={2: A100})
    request = status["devices"]["results"][0]["request"]
    subrequests = {s["name"] for s in claim["spec"]["devices"]["requests"][0]["firstAvailable"]}
    assert request.startswith("gpu/") and request[4:] in subrequests and "a100" in request
    kubernetes_validate.validate(claim_with_status(spec, status, card_memory_mib={H100: 81559, A100: 40960}),
                                 K8S, strict=True)

    with pytest.raises(ValueError, match="no subrequest"):
        allocation(CLAIM, "gpu-1", shares((2, 20480, 20)), claim_spec=claim["spec"], models={2: "Tesla T4"})


def test_a_whole_card_claim_consumes_the_card():
    status = allocation(CLAIM, "gpu-0", shares((0, 81559, 100)))
    assert status["devices"]["results"][0]["consumedCapacity"] == {"memory": "81559Mi", "cores": "100", "shares": "1"}


# --- another allocator's allocation, read as the ledger counts it (`adoption`) ------------------

CARDS = [GpuDevice(uuid="GPU-a", index=0, model="NVIDIA H100 80GB HBM3", memory_mib=81559),
        GpuDevice(uuid="GPU-b", index=1, model="NVIDIA H100 80GB HBM3", memory_mib=81559)]


def _foreign(node: str, *results: dict) -> dict:
    return {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node, "shareID": str(uuid.uuid4()),
                                     **r} for r in results]}, "nodeSelector": node_selector(node)}


def test_another_allocators_allocation_is_read_as_the_shares_it_holds():
    found = _foreign("n1", {"device": "gpu-1", "consumedCapacity": {"memory": "12Gi", "cores": "25", "shares": "1"}},
                     {"device": "gpu-0"})  # (no consumedCapacity: the whole card)
    node, shares = held_shares(found, {"n1": CARDS}.get)
    assert node == "n1" and shares == [DeviceShare(uuid="GPU-a", index=0, memory_mib=81559, cores=100),
                                       DeviceShare(uuid="GPU-b", index=1, memory_mib=12288, cores=25)]
    assert not describes(found, "n1", shares)  # (the whole card's result names no capacity: read with the inventory)
    assert not describes(found, "n2", shares)


@pytest.mark.parametrize(("found", "why"), [
    (_foreign("n1", {"device": "gpu-0", "driver": "gpu.example.com"}), "another driver (gpu.example.com)"),
    (_foreign("n9", {"device": "gpu-0"}), "node n9 is not in Tessera's fleet"),
    (_foreign("n1", {"device": "gpu-7"}), "node n1 has no GPU gpu-7"),
    (_foreign("n1", {"device": "gpu-0", "consumedCapacity": {"memory": "1.5Mi", "cores": "10"}}), "not whole MiB"),
    ({"devices": {"results": []}}, "it allocates no device"),
    ({**_foreign("n1", {"device": "gpu-0"}), "nodeSelector": node_selector("n2")}, "its node selector names n2"),
])
def test_an_allocation_tessera_cannot_hold_says_why(found, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        held_shares(found, {"n1": CARDS}.get)


def test_tesseras_own_allocation_describes_its_shares_whatever_the_servers_spelling():
    shares = [DeviceShare(uuid="GPU-a", index=0, memory_mib=20480, cores=30)]
    written = allocation("c1", "n1", shares)
    written["devices"]["results"][0]["consumedCapacity"]["memory"] = "20Gi"  # as the API server reads it back
    assert describes(written, "n1", shares)
    assert not describes(written, "n1", [DeviceShare(uuid="GPU-a", index=0, memory_mib=20480, cores=40)])
