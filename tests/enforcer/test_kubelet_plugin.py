"""The enforcer as the kubelet's DRA plugin: registration, prepare and unprepare over the real gRPC
sockets, per-claim errors for claims this node must not prepare, idempotence. The enforcer reads the
claims from the real kube-apiserver as its DaemonSet's pod on the node; a read answered 503 once
(a fault the real server cannot be made to give on one path) is the emulator's."""

from __future__ import annotations

import asyncio

import pytest

from tessera.shared.kubeclaims import DRIVER, claim_id

from kubeletkit import ApiServer, NODE, Kubelet, PluginNode
from kit import eventually

ENFORCER = "system:serviceaccount:tessera-system:tessera-enforcer"


async def _running(plugin: PluginNode):
    kubelet = None
    try:
        await plugin.start()
        kubelet = Kubelet(plugin.registry_dir)
        plugin.kubelet = kubelet
        yield plugin
    finally:
        if kubelet is not None:
            await kubelet.close()
        await plugin.close()


@pytest.fixture
async def node(nats_server, tmp_path, kube_plane, plane_namespace):
    plugin = await asyncio.to_thread(PluginNode, nats_url=nats_server.url, workdir=tmp_path, plane=kube_plane,
                                     namespace=plane_namespace)
    async for running in _running(plugin):
        yield running


@pytest.fixture
async def emulated_node(nats_server, tmp_path):
    apiserver = await ApiServer().start()
    try:
        async for running in _running(PluginNode(nats_url=nats_server.url, workdir=tmp_path, apiserver=apiserver)):
            yield running
    finally:
        await apiserver.stop()


def ids(reply) -> list[str]:
    return [cdi for d in reply.devices for cdi in d.cdi_device_ids]


async def test_the_kubelet_registers_the_plugin_and_prepares_this_nodes_claims(node):
    info = await node.kubelet.register()
    assert info.type == "DRAPlugin" and info.name == DRIVER
    assert info.endpoint == str(node.plugin_dir / "dra.sock")
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]
    assert "the kubelet registered DRA plugin" in node.log()

    one = await node.allocate("one", devices=((0, 8000, 50),))
    two = await node.allocate("two", devices=((0, 4000, 25), (1, 16000, 0)))
    elsewhere = await node.allocate("elsewhere", node="gpu-1", devices=((1, 8000, 50),))
    replies = await node.kubelet.prepare(one, two, elsewhere)
    assert set(replies) == {one["uid"], two["uid"], elsewhere["uid"]}

    assert replies[one["uid"]].error == ""
    (device,) = replies[one["uid"]].devices
    assert (list(device.request_names), device.pool_name, device.device_name) == (["gpu"], NODE, "gpu-0")
    assert device.HasField("share_id")
    assert list(device.cdi_device_ids) == [f"{DRIVER}/gpu={claim_id(one['uid'])}"]
    assert replies[two["uid"]].error == ""
    assert [d.device_name for d in replies[two["uid"]].devices] == ["gpu-0", "gpu-1"]
    # the claim's one CDI device carries both GPUs, named once
    assert ids(replies[two["uid"]]) == [f"{DRIVER}/gpu={claim_id(two['uid'])}"]

    assert "gpu-1" in replies[elsewhere["uid"]].error and f"not for this node {NODE}" in replies[elsewhere["uid"]].error
    assert not replies[elsewhere["uid"]].devices and node.leftovers(elsewhere) == []

    # what the container runtime gets: one valid spec per claim, naming that claim's limits
    for ref, limit in ((one, "8000m"), (two, "4000m")):
        spec = node.spec(ref)
        assert spec["kind"] == f"{DRIVER}/gpu" and spec["devices"][0]["name"] == claim_id(ref["uid"])
        assert f"CUDA_DEVICE_MEMORY_LIMIT_0={limit}" in spec["devices"][0]["containerEdits"]["env"]
        assert (node.claim_dir(ref) / "vgpu.conf").stat().st_mode & 0o222 == 0  # read-only limits file
    record, _ = await node.claims.get(claim_id(one["uid"]))
    assert record.state == "prepared"

    again = await node.kubelet.prepare(one, two)
    assert ids(again[one["uid"]]) == ids(replies[one["uid"]])
    assert ids(again[two["uid"]]) == ids(replies[two["uid"]])
    # an older kubelet's v1beta1 call is answered the same way, without the share id it cannot carry
    beta = await node.kubelet.prepare(one, beta=True)
    assert list(beta[one["uid"]].devices[0].cdi_device_ids) == ids(replies[one["uid"]])

    unprepared = await node.kubelet.unprepare(one, two)
    assert {uid: r.error for uid, r in unprepared.items()} == {one["uid"]: "", two["uid"]: ""}
    assert node.leftovers(one) == [] and node.leftovers(two) == []
    # the ledger is released by the claim's deletion, not by unprepare
    ledger, _ = await node.ledger.read_node(NODE)
    assert {claim_id(one["uid"]), claim_id(two["uid"])} <= set(ledger.entries)
    assert {uid: r.error for uid, r in (await node.kubelet.unprepare(one, two)).items()} == \
        {one["uid"]: "", two["uid"]: ""}


async def test_claims_this_node_must_not_prepare_get_their_own_errors(node):
    await node.kubelet.register()
    good = await node.allocate("good")
    unknown = await node.allocate("unknown", in_api=False)
    other_driver = await node.allocate("other", driver="gpu.example.com")
    unledgered = await node.allocate("unledgered", ledger=False)
    mismatched = await node.allocate("mismatched", devices=((0, 8000, 50),), ledger_devices=((1, 8000, 50),))
    replies = await node.kubelet.prepare(good, unknown, other_driver, unledgered, mismatched,
                                         {"namespace": "team-a", "name": "bad", "uid": "not-a-uid"})
    assert replies[good["uid"]].error == "" and ids(replies[good["uid"]])
    assert "does not exist" in replies[unknown["uid"]].error
    assert "no device of driver gpu.tessera.dev (allocated: gpu.example.com)" in replies[other_driver["uid"]].error
    assert "no entry in the ledger of node gpu-0" in replies[unledgered["uid"]].error
    assert "allocated gpu-0 but the ledger of node gpu-0 holds gpu-1" in replies[mismatched["uid"]].error
    assert "not a UUID" in replies["not-a-uid"].error
    for ref in (unknown, other_driver, unledgered, mismatched):
        assert node.leftovers(ref) == []
    assert node.leftovers(good) == [node.claim_dir(good), node.spec_file(good)]


async def test_a_claim_the_kubelet_names_without_a_namespace_or_name_is_refused_by_field(node):
    """An empty name would make the read a list of every ResourceClaim (forbidden by the RBAC, and
    reported as the API server's trouble); a '/' would read another path."""
    await node.kubelet.register()
    good = await node.allocate("good")
    seen = len(node.plane.audit())
    ns = node.namespace
    bad = [{"namespace": ns, "name": "", "uid": "3f1e9a9e-0c1a-4d2b-9a51-0d6f1c1e7a01"},
           {"namespace": "", "name": "x", "uid": "3f1e9a9e-0c1a-4d2b-9a51-0d6f1c1e7a02"},
           {"namespace": ns, "name": "x/status", "uid": "3f1e9a9e-0c1a-4d2b-9a51-0d6f1c1e7a03"}]
    replies = await node.kubelet.prepare(good, *bad)
    assert replies[good["uid"]].error == ""
    for ref, field in zip(bad, ("name", "namespace", "name")):
        error = replies[ref["uid"]].error
        assert f"claim {field} {ref[field]!r}" in error and "kubelet" in error, error
        assert not replies[ref["uid"]].devices
    # the enforcer's reads of claims (the API server's audit log): the good claim's, nothing else
    asked = [(e["verb"], e["requestURI"]) for e in node.plane.audit()[seen:]
             if e["user"]["username"] == ENFORCER and (e.get("objectRef") or {}).get("resource") == "resourceclaims"]
    assert asked and not [(verb, uri) for verb, uri in asked
                          if verb != "get" or not uri.endswith(f"/resourceclaims/{good['name']}")], asked


async def test_an_api_server_that_cannot_answer_fails_the_claim_until_it_can(emulated_node):
    node = emulated_node
    await node.kubelet.register()
    claim = await node.allocate("flaky")
    node.apiserver.fail("GET", rf"/resourceclaims/{claim['name']}$", status=503, times=1)
    (reply,) = (await node.kubelet.prepare(claim)).values()
    assert f"ResourceClaim team-a/{claim['name']} could not be read" in reply.error
    assert "the kubelet asks again" in reply.error and node.leftovers(claim) == []
    (reply,) = (await node.kubelet.prepare(claim)).values()
    assert reply.error == "" and ids(reply) == [f"{DRIVER}/gpu={claim_id(claim['uid'])}"]


async def test_kubernetes_mode_without_an_api_server_to_reach_stops_at_start(nats_server, tmp_path):
    from kubeletkit import PROFILES

    from tessera.cli.cluster import LocalCluster

    cluster = LocalCluster(workdir=tmp_path, profile=PROFILES / "tiny.yaml", nats_url=nats_server.url)
    env = {"TESSERA_NODE": NODE, "TESSERA_KUBERNETES": "true", "KUBECONFIG": str(tmp_path / "missing"),
           "HOME": str(tmp_path), "KUBERNETES_SERVICE_HOST": "", "TESSERA_CDI_DIR": str(tmp_path / "cdi"),
           "TESSERA_KUBELET_REGISTRY_DIR": str(tmp_path / "registry"),
           "TESSERA_KUBELET_PLUGIN_DIR": str(tmp_path / "plugin")}
    process = cluster.spawn("enforcer", instance="enforcer-nokube", env=env)
    try:
        assert process.proc.wait(60) == 2
    finally:
        cluster.stop()
    assert "the Kubernetes API cannot be configured" in process.log_path.read_text()
    assert not (tmp_path / "registry" / f"{DRIVER}-reg.sock").exists()


async def test_an_allocated_event_for_a_resourceclaims_claim_waits_for_the_kubelet(node):
    """On Kubernetes the kubelet decides when a claim is prepared (its pod is about to start here)."""
    from tessera.shared import subjects
    from tessera.shared.events import ClaimAllocated

    await node.kubelet.register()
    claim = await node.allocate("later")
    record, _ = await node.claims.get(claim_id(claim["uid"]))
    ack = await node.bus.publish(
        subjects.claim(record.tenant, record.claim, "allocated", NODE),
        ClaimAllocated(claim=record.claim, tenant=record.tenant, node=NODE, devices=record.devices),
        msg_id=f"{record.claim}:allocated")
    await node.consuming()

    async def acknowledged() -> bool:
        info = await node.bus.consumer_info(subjects.STREAM_CLAIMS, f"enforcer-{NODE}")
        return info.ack_floor.stream_seq >= ack.seq

    await eventually(acknowledged, timeout=30, every=0.05, what="the enforcer acknowledging the allocated event")
    assert node.leftovers(claim) == []
    assert (await node.claims.get(record.claim))[0].state == "allocated"
    (reply,) = (await node.kubelet.prepare(claim)).values()
    assert reply.error == "" and node.leftovers(claim) == [node.claim_dir(claim), node.spec_file(claim)]
