"""A claim of several requests (a pod's GPU containers) is prepared as one CDI device per request.

The kubelet gives each container the CDI devices of the request its ``resources.claims`` entry
names (NodePrepareResources' ``requestNames``). So that each container is held to its own limits,
and cannot spend another's budget, every request gets its own accounting, limits and preload files
and its own CDI device carrying only its GPUs; and the ResourceClaim's allocation is matched to the
ledger by request and GPU, two requests being allowed one GPU (issue 22, defect 5).
"""

from __future__ import annotations

import json

import pytest

from cdischema import validate
from tessera.enforcer import cdi
from tessera.enforcer.kubelet import allocation
from tessera.shared.events import DeviceShare, GpuDevice, LedgerEntry

UUID0 = "GPU-5e55e7a0-0000-4000-8000-000000000000"
UUID1 = "GPU-5e55e7a0-0000-4000-8000-000000000001"
GPUS = {u: GpuDevice(uuid=u, index=i, model="Sim H100", memory_mib=81920) for i, u in enumerate((UUID0, UUID1))}
UID = "6f1c2a4e-8b3d-4c5e-9f7a-1b2c3d4e5f60"
CLAIM = f"k8s-{UID}"
# "train" has two GPUs, "eval" shares GPU 0 with it
SHARES = [DeviceShare(uuid=UUID0, index=0, memory_mib=3000, cores=0, request="train"),
          DeviceShare(uuid=UUID1, index=1, memory_mib=3000, cores=0, request="train"),
          DeviceShare(uuid=UUID0, index=0, memory_mib=1000, cores=20, request="eval")]


def _env(device: dict) -> dict[str, str]:
    return dict(e.split("=", 1) for e in device["containerEdits"]["env"])


def test_each_request_gets_its_own_cdi_device_limits_and_budget(preparation):
    prepared = preparation.materialize(CLAIM, SHARES, GPUS)
    assert prepared.cdi_devices == {"train": f"gpu.tessera.dev/gpu={CLAIM}.train",
                                    "eval": f"gpu.tessera.dev/gpu={CLAIM}.eval"}
    spec_file = cdi.spec_path(preparation.settings.cdi_dir, CLAIM)
    spec = json.loads(spec_file.read_text())
    validate(spec)
    train, evaluate = spec["devices"]
    assert [train["name"], evaluate["name"]] == [f"{CLAIM}.train", f"{CLAIM}.eval"]
    t, e = _env(train), _env(evaluate)
    assert (t["CUDA_VISIBLE_DEVICES"], t["CUDA_DEVICE_MEMORY_LIMIT_0"], t["CUDA_DEVICE_MEMORY_LIMIT_1"]) == \
        (f"{UUID0},{UUID1}", "3000m", "3000m")
    assert (e["CUDA_VISIBLE_DEVICES"], e["CUDA_DEVICE_MEMORY_LIMIT_0"], e["CUDA_DEVICE_SM_LIMIT"]) == \
        (UUID0, "1000m", "20")
    assert "CUDA_DEVICE_MEMORY_LIMIT_1" not in e
    # each its own accounting file and read-only limits file, in its own directory
    directory = preparation.dirs.of(CLAIM)
    own = {r.path.name: r for r in directory.requests()}
    assert set(own) == {"train", "eval"}
    assert t["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == str(own["train"].cache) != e["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
    assert "CUDA_DEVICE_MEMORY_LIMIT_0=1000m" in own["eval"].config.read_text().splitlines()
    mounts = {m["containerPath"]: m["hostPath"] for m in evaluate["containerEdits"]["mounts"]}
    assert mounts["/etc/tessera/vgpu.conf"] == str(own["eval"].config)
    assert mounts[str(own["eval"].cache)] == str(own["eval"].cache) and str(own["train"].cache) not in mounts

    assert preparation.present(CLAIM)
    preparation.remove(CLAIM)
    assert not spec_file.exists() and not directory.exists()


def test_a_claim_of_one_request_is_prepared_as_before(preparation):
    prepared = preparation.materialize("c-1", [DeviceShare(uuid=UUID0, index=0, memory_mib=3000, cores=0)], GPUS)
    assert prepared.cdi_device == "gpu.tessera.dev/gpu=c-1" and prepared.cdi_devices == {}
    assert preparation.dirs.of("c-1").cache.exists() and preparation.dirs.of("c-1").requests() == []


def _claim(results: list[tuple[str, int, str]]) -> dict:
    return {"metadata": {"namespace": "team-a", "name": "trainer-x", "uid": UID},
            "status": {"allocation": {"devices": {"results": [
                {"request": request, "driver": "gpu.tessera.dev", "pool": "n1", "device": f"gpu-{index}",
                 "shareID": f"s-{request}-{index}", "consumedCapacity": {"memory": memory}}
                for request, index, memory in results]}}}}


def test_the_allocation_is_matched_to_the_ledger_by_request_and_gpu():
    entry = LedgerEntry(claim=CLAIM, tenant="a", shares=SHARES)
    ok = _claim([("train", 0, "3000Mi"), ("train", 1, "3000Mi"), ("eval", 0, "1000Mi")])
    devices = allocation.check(ok, uid=UID, node="n1", entry=entry)
    assert [(d.request, d.device, d.share.memory_mib) for d in devices] == [
        ("train", "gpu-0", 3000), ("train", "gpu-1", 3000), ("eval", "gpu-0", 1000)]
    swapped = _claim([("train", 0, "3000Mi"), ("eval", 1, "3000Mi"), ("eval", 0, "1000Mi")])
    with pytest.raises(allocation.AllocationMismatch, match="ledger of node n1 holds eval: gpu-0, train: gpu-0"):
        allocation.check(swapped, uid=UID, node="n1", entry=entry)
    wrong_amount = _claim([("train", 0, "3000Mi"), ("train", 1, "3000Mi"), ("eval", 0, "3000Mi")])
    with pytest.raises(allocation.AllocationMismatch, match="consumes memory 3000Mi but the ledger"):
        allocation.check(wrong_amount, uid=UID, node="n1", entry=entry)
