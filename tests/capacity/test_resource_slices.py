"""The capacity publisher's DRA ResourceSlices: the v1 shape the API server accepts, and the writer
on the session's real kube-apiserver (server-side apply, pool generation, owner, retries), acting
as the capacity DaemonSet's pod on its node, which is all deploy/k8s lets it write."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
import yaml

from tessera.capacity import slices
from tessera.capacity.kube import SliceWriter
from tessera.capacity.service import CapacityService, CapacitySettings
from tessera.shared import profile
from tessera.shared.errors import ConfigError
from tessera.shared.events import GpuDevice, NodeInventory
from tessera.shared.kubeapi import KubeApi, object_path

from kit import eventually
from kit.kubecluster import kubelet_deletes_slices, node_bound_identity

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
CAPACITY = "system:serviceaccount:tessera-system:tessera-capacity"
WRITES = ("create", "update", "patch", "delete")


class NodeSlices:
    """One node of this test's own (a Node object, as its kubelet registered it) and what the API
    server holds and was asked about its slice; writers act as the node's capacity pod
    (`node_bound_identity`), as deploy/k8s's tessera-node-slices policy requires."""

    def __init__(self, plane) -> None:
        self.plane = plane
        self.name = f"gpu-node-{uuid.uuid4().hex[:8]}"
        self.slice = slices.slice_name(self.name)
        self.identity = node_bound_identity(plane, "capacity.yaml", self.name)  # (makes the Node)
        self.admin = KubeApi.for_kubeconfig(plane.admin_kubeconfig)

    def writer(self) -> SliceWriter:
        return SliceWriter(KubeApi.for_kubeconfig(self.identity))

    async def stored(self) -> dict | None:
        return await self.admin.get(object_path(*RS, self.slice))

    def writes(self) -> list[dict]:
        """The capacity pod's writes of this node's slice, from the API server's audit log."""
        return [e for e in self.plane.audit() if e["user"]["username"] == CAPACITY and e["verb"] in WRITES
                and (e.get("objectRef") or {}).get("name") == self.slice]

    async def close(self) -> None:
        await self.admin.close()
        await asyncio.to_thread(self.plane.kubectl, "delete", "node", self.name, "--wait=false", check=False)


@pytest.fixture
async def own_node(kube_plane):
    made = await asyncio.to_thread(NodeSlices, kube_plane)
    try:
        yield made
    finally:
        await made.close()


async def test_the_writer_applies_once_and_raises_the_generation_only_on_change(own_node):
    kubelet_node = await own_node.admin.get(object_path("v1", "nodes", own_node.name))  # its uid is the server's
    writer = own_node.writer()
    try:
        assert await writer.publish(node(own_node.name)) == 1
        doc = await own_node.stored()
        kubernetes_validate.validate(doc, K8S, strict=True)
        assert len(doc["spec"]["devices"]) == 2
        # goes when the Node goes
        assert doc["metadata"]["ownerReferences"][0]["uid"] == kubelet_node["metadata"]["uid"]
        # (the audit log is written before the API server answers: a write is in it once its answer is here)
        writes = len(own_node.writes())
        assert await writer.publish(node(own_node.name)) is None  # nothing changed: nothing written
        assert len(own_node.writes()) == writes
        assert await writer.publish(node(own_node.name, healthy=(True, False))) == 2  # a GPU fell sick: generation 2
        doc = await own_node.stored()
        assert doc["spec"]["pool"]["generation"] == 2 and doc["spec"]["devices"][1]["taints"]
        applies = own_node.writes()
        assert applies and all(e["verb"] == "patch" for e in applies), [(e["verb"], e["requestURI"]) for e in applies]
        for entry in applies:  # server-side applies under the publisher's field manager
            query = parse_qs(urlsplit(entry["requestURI"]).query)
            assert query.get("fieldManager") == ["tessera-capacity"] and query.get("force") == ["true"], query
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


async def test_a_publisher_in_kubernetes_mode_writes_every_nodes_slice(kube_plane, nats_server, tmp_path,
                                                                         profiles_dir):
    """The service process itself, reaching the real API server through a kubeconfig: one per node
    of tiny.yaml, as the capacity DaemonSet runs it (its pod's token, its node's part of the fleet)."""
    from tessera.cli.cluster import LocalCluster

    fleet = yaml.safe_load((profiles_dir / "tiny.yaml").read_text())
    for group in fleet["groups"]:  # (nodes of this test's own on the session's plane)
        group["prefix"] = f"{group['prefix']}{uuid.uuid4().hex[:6]}"
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    names = [inv.node for inv in profile.load(tmp_path / "fleet.yaml")]
    identities = {name: await asyncio.to_thread(node_bound_identity, kube_plane, "capacity.yaml", name)
                  for name in names}
    admin = KubeApi.for_kubeconfig(kube_plane.admin_kubeconfig)
    cluster = LocalCluster(workdir=tmp_path, profile=tmp_path / "fleet.yaml", nats_url=nats_server.url)
    for name in names:
        cluster.spawn("capacity", instance=f"capacity-{name}", env={
            "TESSERA_KUBERNETES": "true", "KUBECONFIG": str(identities[name]), "TESSERA_CAPACITY_NODES": name,
            "TESSERA_SLICES_NEED_PLUGIN": "false"})  # (no kubelet)

    async def written() -> dict[str, dict] | None:
        docs = {name: await admin.get(object_path(*RS, slices.slice_name(name))) for name in names}
        return docs if all(docs.values()) else None

    try:
        await asyncio.to_thread(cluster.wait_ready, 60)
        docs = await eventually(written, timeout=30, what="a slice of each node")
        assert sorted(d["spec"]["nodeName"] for d in docs.values()) == sorted(names) and len(names) == 2
        for doc in docs.values():
            kubernetes_validate.validate(doc, K8S, strict=True)
            assert [d["name"] for d in doc["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    finally:
        cluster.stop()
        await admin.close()
        await asyncio.to_thread(kube_plane.kubectl, "delete", "node", *names, "--wait=false", check=False)


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


async def test_a_wiped_or_edited_slice_is_restored_at_the_same_generation(own_node):
    sick = node(own_node.name, healthy=(True, False))
    writer = own_node.writer()
    try:
        assert await writer.publish(node(own_node.name)) == 1
        assert await writer.publish(sick) == 2
        await kubelet_deletes_slices(own_node.plane, own_node.name)  # the kubelet starting: its node's slices go
        assert await own_node.stored() is None
        assert await writer.publish(sick) == 2  # same devices: same pool generation
        doc = await own_node.stored()
        assert doc["spec"]["pool"]["generation"] == 2 and len(doc["spec"]["devices"]) == 2
        await own_node.admin.patch(object_path(*RS, own_node.slice), {"spec": {"devices": []}})  # someone else's edit
        assert await writer.publish(sick) == 2
        assert len((await own_node.stored())["spec"]["devices"]) == 2
    finally:
        await writer.close()
    restarted = own_node.writer()  # from empty memory: reads the generation back
    try:
        assert await restarted.publish(sick) is None
        assert await restarted.publish(node(own_node.name)) == 3  # the GPU is well again: a new generation
    finally:
        await restarted.close()
