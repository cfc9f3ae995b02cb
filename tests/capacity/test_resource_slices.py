"""The capacity publisher's DRA ResourceSlices: the v1 shape the API server accepts, and the writer
against the strict API-server emulator of tests/kubernetes, which validates every slice written
(server-side apply, pool generation, owner, retries)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import kubernetes_validate
import pytest

from tessera.capacity import slices
from tessera.capacity.kube import SliceWriter
from tessera.capacity.service import CapacityService, CapacitySettings
from tessera.shared.errors import ConfigError
from tessera.shared.events import GpuDevice, NodeInventory
from tessera.shared.kubeapi import KubeApi

from kubetessera import write_kubeconfig

K8S = "1.34"  # resource.k8s.io/v1 with consumable capacity (KEP-5075)


def node(name: str = "gpu-node-1", healthy=(True, True)) -> NodeInventory:
    return NodeInventory(node=name, cpu_millis=64000, devices=[
        GpuDevice(uuid=f"GPU-{name}-{i}", index=i, model="NVIDIA H100 80GB HBM3", memory_mib=81559, max_shares=4,
                  healthy=ok) for i, ok in enumerate(healthy)])


def test_a_slice_has_the_v1_shape_the_translators_claims_ask_for():
    doc = slices.resource_slice(node(), 1, "uid-1")
    kubernetes_validate.validate(doc, K8S, strict=True)
    spec = doc["spec"]
    assert spec["driver"] == "gpu.tessera.dev" and spec["nodeName"] == "gpu-node-1"
    assert spec["pool"] == {"name": "gpu-node-1", "generation": 1, "resourceSliceCount": 1}
    gpu = spec["devices"][0]
    assert gpu["name"] == "gpu-0" and gpu["allowMultipleAllocations"] is True
    assert gpu["attributes"] == {"model": {"string": "NVIDIA H100 80GB HBM3"}, "uuid": {"string": "GPU-gpu-node-1-0"},
                                 "productName": {"string": "NVIDIA H100 80GB HBM3"}, "index": {"int": 0}}
    # a claim that asks for no memory (or no cores) takes the whole card; any whole MiB / percent otherwise
    assert gpu["capacity"]["memory"] == {"value": "81559Mi", "requestPolicy": {
        "default": "81559Mi", "validRange": {"min": "1Mi", "step": "1Mi"}}}
    assert gpu["capacity"]["cores"] == {"value": "100", "requestPolicy": {
        "default": "100", "validRange": {"min": "0", "max": "100", "step": "1"}}}
    assert gpu["capacity"]["shares"] == {"value": "4", "requestPolicy": {"default": "1", "validValues": ["1"]}}
    assert doc["metadata"]["ownerReferences"][0] == {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-1",
                                                     "uid": "uid-1", "controller": True}


def test_a_sick_gpu_is_tainted_and_names_are_dns_safe():
    doc = slices.resource_slice(node("GPU_Node.7", healthy=(True, False)), 2)
    kubernetes_validate.validate(doc, "1.34", strict=True)
    assert [(d["name"], d.get("taints")) for d in doc["spec"]["devices"]] == [
        ("gpu-0", None), ("gpu-1", [{"key": "gpu.tessera.dev/unhealthy", "effect": "NoSchedule"}])]
    # where the API server would drop the taint (DRADeviceTaints off), the sick GPU is left out
    untainted = slices.resource_slice(node("GPU_Node.7", healthy=(True, False)), 2, taints=False)
    assert [d["name"] for d in untainted["spec"]["devices"]] == ["gpu-0"]
    assert doc["metadata"]["name"] == "gpu-node.7-gpu-tessera-dev"
    assert "ownerReferences" not in doc["metadata"]  # no Node object known (a simulated node)


RS = ("resource.k8s.io/v1", "resourceslices")


def stored_slices(apiserver) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in apiserver.objects(*RS)}


async def test_the_writer_applies_once_and_raises_the_generation_only_on_change(apiserver):
    # the real node's Node object (its uid is the API server's)
    kubelet_node = await apiserver.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    writer = SliceWriter(KubeApi.for_url(apiserver.url))
    try:
        assert await writer.publish(node()) == 1
        (doc,) = stored_slices(apiserver).values()
        kubernetes_validate.validate(doc, K8S, strict=True)
        assert len(doc["spec"]["devices"]) == 2
        # goes when the Node goes
        assert doc["metadata"]["ownerReferences"][0]["uid"] == kubelet_node["metadata"]["uid"]
        writes = len(apiserver.writes)
        assert await writer.publish(node()) is None  # nothing changed: nothing written
        assert len(apiserver.writes) == writes
        assert await writer.publish(node(healthy=(True, False))) == 2  # a GPU fell sick: generation 2
        (doc,) = stored_slices(apiserver).values()
        assert doc["spec"]["pool"]["generation"] == 2 and doc["spec"]["devices"][1]["taints"]
        applies = [query for method, path, query in apiserver.requests if method == "PATCH" and RS[1] in path]
        assert applies and all(q.get("fieldManager") == "tessera-capacity" and q.get("force") == "true"
                               for q in applies)
    finally:
        await writer.close()


class Flaky:
    """A slice writer whose API server is away for the first `fails` calls."""

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.written: list[str] = []

    async def publish(self, inv: NodeInventory):
        if self.fails:
            self.fails -= 1
            raise ConnectionError("API server unreachable")
        self.written.append(inv.node)
        return 1


async def test_the_service_retries_a_slice_it_could_not_write_and_then_leaves_it(caplog):
    settings = CapacitySettings(kubernetes=True, slices_need_plugin=False)
    writer = Flaky(fails=1)
    svc = CapacityService(SimpleNamespace(bus=None), settings, [node("a"), node("b")], slices=writer)
    await svc._publish_slices()  # "a" fails (logged), "b" is written
    assert writer.written == ["b"] and svc.slices_due == {"a"}
    assert "ResourceSlice of a not written" in caplog.text
    await svc._publish_slices()  # the next heartbeat: "a" now
    assert writer.written == ["b", "a"] and svc.slices_due == set()
    await svc._publish_slices()  # nothing left to do
    assert writer.written == ["b", "a"]


def test_kubernetes_mode_is_off_unless_asked_and_refuses_nonsense():
    assert CapacitySettings.from_env({}).kubernetes is False
    assert CapacitySettings.from_env({"TESSERA_KUBERNETES": "true"}).kubernetes is True
    with pytest.raises(ConfigError, match="TESSERA_KUBERNETES"):
        CapacitySettings.from_env({"TESSERA_KUBERNETES": "sometimes"})


async def test_a_publisher_in_kubernetes_mode_writes_every_nodes_slice(apiserver, nats_server, tmp_path,
                                                                         profiles_dir):
    """The service process itself, reaching the emulated API server through a kubeconfig."""
    from tessera.cli.cluster import LocalCluster

    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", apiserver.url)
    cluster = LocalCluster(workdir=tmp_path, profile=profiles_dir / "tiny.yaml", nats_url=nats_server.url)
    cluster.spawn("capacity", instance="capacity-k8s", env={"TESSERA_KUBERNETES": "true", "KUBECONFIG": str(kubeconfig),
                                                           "TESSERA_SLICES_NEED_PLUGIN": "false"})  # (no kubelet)
    try:
        await asyncio.to_thread(cluster.wait_ready, 60)
        await apiserver.wait_for(lambda: len(stored_slices(apiserver)) == 2, timeout=30)
        docs = stored_slices(apiserver)
        assert sorted(d["spec"]["nodeName"] for d in docs.values()) == ["gpu-0", "gpu-1"]
        for doc in docs.values():
            kubernetes_validate.validate(doc, K8S, strict=True)
            assert [d["name"] for d in doc["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    finally:
        cluster.stop()


class Recorder:
    def __init__(self) -> None:
        self.published: list[tuple[str, int]] = []

    async def publish(self, inv: NodeInventory):
        self.published.append((inv.node, len(inv.devices)))
        return 1


async def test_a_lost_node_shows_no_devices_until_it_is_back():
    # (its enforcer fell silent: the publisher on the node is alive and says so in the slice)
    writer = Recorder()
    svc = CapacityService(SimpleNamespace(bus=None), CapacitySettings(kubernetes=True, slices_need_plugin=False), [node("a"), node("b")],
                          slices=writer)
    await svc._publish_slices()
    assert sorted(writer.published) == [("a", 2), ("b", 2)]
    await svc._mark_lost("a", 0.0, "its enforcer has been silent for 95s")  # (no NATS here: the label part gives up)
    assert writer.published[-1] == ("a", 0)
    await svc._mark_lost("zz", 0.0, "not ours")  # a node another publisher serves: its slice is not ours
    assert writer.published[-1] == ("a", 0)
    await svc._restore("a")
    assert writer.published[-1] == ("a", 2) and svc.slices_due == set()


async def test_a_wiped_or_edited_slice_is_restored_at_the_same_generation(apiserver):
    name = slices.slice_name("gpu-node-1")
    writer = SliceWriter(KubeApi.for_url(apiserver.url))
    try:
        assert await writer.publish(node()) == 1
        assert await writer.publish(node(healthy=(True, False))) == 2
        await apiserver.delete(*RS, name)  # the kubelet starting: every slice of its node goes
        assert stored_slices(apiserver) == {}
        assert await writer.publish(node(healthy=(True, False))) == 2  # same devices: same pool generation
        (doc,) = stored_slices(apiserver).values()
        assert doc["spec"]["pool"]["generation"] == 2 and len(doc["spec"]["devices"]) == 2
        await apiserver.patch(*RS, name, {"spec": {"devices": []}})  # someone else's edit
        assert await writer.publish(node(healthy=(True, False))) == 2
        assert len(stored_slices(apiserver)[name]["spec"]["devices"]) == 2
    finally:
        await writer.close()
    restarted = SliceWriter(KubeApi.for_url(apiserver.url))  # from empty memory: reads the generation back
    try:
        assert await restarted.publish(node(healthy=(True, False))) is None
        assert await restarted.publish(node()) == 3  # the GPU is well again: a new generation
    finally:
        await restarted.close()
