"""The kubelet plugin's checkpoint: a plugin killed between prepare and unprepare still unprepares
and leaks nothing; a half-done prepare is rolled back; a corrupt checkpoint loses nothing already
prepared; a reboot starts clean; a checkpoint that cannot be written fails only the claim at hand."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tessera.enforcer.kubelet.checkpoint import Checkpoint, CheckpointClaim
from tessera.shared.kubeclaims import claim_id

from kubeletkit import Kubelet, PluginNode


@pytest.fixture
async def node(nats_server, tmp_path, kube_plane, plane_namespace):
    plugin = await asyncio.to_thread(PluginNode, nats_url=nats_server.url, workdir=tmp_path, plane=kube_plane,
                                     namespace=plane_namespace)
    kubelets: list[Kubelet] = []

    async def kubelet() -> Kubelet:
        """A kubelet that (re)discovers the plugin, as after the plugin's socket came back."""
        k = Kubelet(plugin.registry_dir)
        kubelets.append(k)
        await k.register()
        return k

    plugin.connect = kubelet
    try:
        await plugin.start()
        yield plugin
    finally:
        for k in kubelets:
            await k.close()
        await plugin.close()


def ids(reply) -> list[str]:
    assert reply.error == "", reply.error
    return [cdi for d in reply.devices for cdi in d.cdi_device_ids]


async def test_a_plugin_killed_between_prepare_and_unprepare_still_unprepares_and_leaks_nothing(node):
    kubelet = await node.connect()
    claim = await node.allocate("train")
    before = ids((await kubelet.prepare(claim))[claim["uid"]])
    node.kill()
    await kubelet.close()
    assert node.leftovers(claim) == [node.claim_dir(claim), node.spec_file(claim)]  # prepared stays prepared

    await node.start()
    kubelet = await node.connect()
    assert f"1 claim(s) prepared in this boot ({node.namespace}/{claim['name']})" in node.log()
    # the restarted plugin knows the claim: the same answer, from its checkpoint
    assert ids((await kubelet.prepare(claim))[claim["uid"]]) == before
    assert (await kubelet.unprepare(claim))[claim["uid"]].error == ""
    assert node.leftovers(claim) == []
    # The claim is still allocated (its pod may come back): a restart must not make its files again
    # on the enforcer's own (bus) path; only the kubelet's prepare does.
    node.stop()
    await node.start()
    await node.consuming()
    assert node.leftovers(claim) == []


async def test_a_prepare_cut_short_is_rolled_back_at_start(node):
    kubelet = await node.connect()
    done = await node.allocate("done")
    ids((await kubelet.prepare(done))[done["uid"]])
    node.stop()
    # What a plugin killed mid-prepare leaves: a "preparing" entry, a directory, perhaps a spec.
    cut = {"namespace": "team-a", "name": "cut", "uid": str(uuid.uuid4())}
    checkpoint = Checkpoint(node.plugin_dir / "checkpoint.json")
    body = checkpoint.read("")
    body.claims[cut["uid"]] = CheckpointClaim(uid=cut["uid"], namespace="team-a", name="cut",
                                              claim=claim_id(cut["uid"]), state="preparing")
    checkpoint.write(body)
    node.claim_dir(cut).mkdir(parents=True)
    node.spec_file(cut).write_text("{}")

    await node.start()
    assert node.leftovers(cut) == []
    assert "rolling back the unfinished prepare of ResourceClaim team-a/cut" in node.log()
    assert set(checkpoint.read("").claims) == {done["uid"]}
    assert node.leftovers(done) == [node.claim_dir(done), node.spec_file(done)]


async def test_a_corrupt_checkpoint_is_kept_aside_and_nothing_prepared_is_lost(node):
    kubelet = await node.connect()
    claim = await node.allocate("keep")
    before = ids((await kubelet.prepare(claim))[claim["uid"]])
    usage = node.claim_dir(claim) / "vgpu.cache"
    usage.write_bytes(b"accounting of a running workload")
    node.kill()
    await kubelet.close()
    path = node.plugin_dir / "checkpoint.json"
    torn = path.read_bytes()[:-20]
    path.write_bytes(torn)

    await node.start()
    kubelet = await node.connect()
    log = node.log()
    assert f"the checkpoint {path} is not a checkpoint" in log
    assert f"rebuilt 1 prepared claim(s) from their directories ({claim_id(claim['uid'])})" in log
    (aside,) = node.plugin_dir.glob("checkpoint.json.corrupt-*")
    assert aside.read_bytes() == torn
    assert usage.read_bytes() == b"accounting of a running workload"
    assert ids((await kubelet.prepare(claim))[claim["uid"]]) == before
    assert (await kubelet.unprepare(claim))[claim["uid"]].error == ""
    assert node.leftovers(claim) == []


async def test_an_edited_checkpoint_fails_its_checksum(node):
    kubelet = await node.connect()
    claim = await node.allocate("edited")
    ids((await kubelet.prepare(claim))[claim["uid"]])
    node.stop()
    path = node.plugin_dir / "checkpoint.json"
    path.write_bytes(path.read_bytes().replace(b'"prepared"', b'"preparing"'))

    await node.start()
    assert "fails its checksum (torn or edited)" in node.log()
    # believed, the edit would have rolled the claim back; rebuilt from its directory, it stays
    assert node.leftovers(claim) == [node.claim_dir(claim), node.spec_file(claim)]


@pytest.mark.parametrize("corrupt", [False, True], ids=["checkpoint", "corrupt-checkpoint"])
async def test_a_reboot_starts_clean(node, corrupt):
    kubelet = await node.connect()
    claim = await node.allocate("before-reboot")
    ids((await kubelet.prepare(claim))[claim["uid"]])
    node.stop()
    node.boot_file.write_text(str(uuid.uuid4()) + "\n")
    if corrupt:  # then only the claim directory's own record can tell which boot it is from
        (node.plugin_dir / "checkpoint.json").write_text("{")

    await node.start()
    kubelet = await node.connect()
    assert ("was prepared in boot" if corrupt else "the node rebooted") in node.log()
    assert node.leftovers(claim) == []
    assert Checkpoint(node.plugin_dir / "checkpoint.json").read("").claims == {}
    # the kubelet prepares the pod's claims again after a reboot: made afresh
    assert ids((await kubelet.prepare(claim))[claim["uid"]])
    assert node.leftovers(claim) == [node.claim_dir(claim), node.spec_file(claim)]


async def test_a_checkpoint_that_cannot_be_written_fails_only_the_claim_being_prepared(node):
    kubelet = await node.connect()
    first = await node.allocate("first")
    ids((await kubelet.prepare(first))[first["uid"]])
    (node.plugin_dir / ".checkpoint.json.tmp").mkdir()  # the atomic write's temporary file cannot be made
    second = await node.allocate("second", devices=((1, 1000, 10),))
    reply = (await kubelet.prepare(first, second))
    assert ids(reply[first["uid"]])  # prepared before: still answered
    error = reply[second["uid"]].error
    assert f"the checkpoint {node.plugin_dir / 'checkpoint.json'} could not be written" in error
    assert "was not prepared" in error and node.leftovers(second) == []
    assert node.leftovers(first) == [node.claim_dir(first), node.spec_file(first)]


@pytest.fixture
async def in_process(nats_server, tmp_path, kube_plane, plane_namespace):
    """``make()`` -> a DraPlugin in this process on a node's directories, for what a process test
    cannot arrange (a failing rename, two plugins at once); the node's enforcer process made the
    streams and buckets and is stopped."""
    from tessera.enforcer.claimdir import ClaimDirs
    from tessera.enforcer.kubelet.kube import ClaimReader
    from tessera.enforcer.kubelet.plugin import DraPlugin
    from tessera.enforcer.preparation import Preparation
    from tessera.enforcer.settings import EnforcerSettings
    from tessera.shared.kubeapi import KubeApi

    node = await asyncio.to_thread(PluginNode, nats_url=nats_server.url, workdir=tmp_path, plane=kube_plane,
                                   namespace=plane_namespace)
    settings = EnforcerSettings.from_env({k: v for k, v in node.env.items() if k.startswith("TESSERA_")})
    readers = []

    async def no_devices():
        return {}

    async def announce(record, prepared):
        pass

    def make() -> DraPlugin:
        readers.append(ClaimReader(KubeApi.for_kubeconfig(node.kubeconfig)))
        return DraPlugin(settings, Preparation(settings, ClaimDirs(settings.state_dir)), node.ledger, node.claims,
                         readers[-1], inventory=no_devices, announce=announce)

    node.make = make
    node.checkpoint_path = settings.kubelet_plugin_dir / "checkpoint.json"
    try:
        await node.start()
        node.stop()
        yield node
    finally:
        for reader in readers:
            await reader.close()
        await node.close()


async def test_a_corrupt_checkpoint_that_cannot_be_moved_aside_fails_each_new_prepare_saying_so(in_process):
    """Every new prepare names the checkpoint and what is wrong with it, what was prepared is still
    answered, unprepare still works, and removing the file heals."""
    from tessera.enforcer.kubelet.plugin import ClaimRef

    node, plugin = in_process, in_process.make()
    kept = ClaimRef(**await node.allocate("kept"))
    assert (await plugin.prepare([kept]))[kept.uid].error == ""
    checkpoint = node.checkpoint_path
    checkpoint.write_text("not json")

    def refuse():
        raise PermissionError(13, "Permission denied")

    plugin.checkpoint.set_aside = refuse
    new = ClaimRef(**await node.allocate("new", devices=((1, 1000, 10),)))
    results = await plugin.prepare([kept, new])
    error = results[new.uid].error
    assert f"the checkpoint {checkpoint} is not a checkpoint" in error
    assert "could not be moved aside ([Errno 13] Permission denied)" in error and "until it is removed" in error
    # what was prepared is still answered, rebuilt from its directory
    assert results[kept.uid].error == "" and results[kept.uid].devices[0].cdi_ids == [
        f"gpu.tessera.dev/gpu={claim_id(kept.uid)}"]
    assert node.leftovers(vars(new)) == []
    assert node.leftovers(vars(kept)) == [node.claim_dir(vars(kept)), node.spec_file(vars(kept))]
    assert checkpoint.read_text() == "not json"  # left for whoever investigates

    checkpoint.unlink()  # the operator's fix
    results = await plugin.prepare([kept, new])
    assert results[kept.uid].error == "" and results[new.uid].error == ""
    assert (await plugin.unprepare([kept, new])) == {kept.uid: "", new.uid: ""}
    assert node.leftovers(vars(kept)) == [] and node.leftovers(vars(new)) == []


async def test_two_plugins_on_one_node_prepare_a_claim_once(in_process):
    """The node-wide lock: a second instance (a rolling update) waits, then finds the first's entry."""
    from tessera.enforcer.kubelet.plugin import ClaimRef

    node = in_process
    first, second = node.make(), node.make()
    made = []
    for plugin in (first, second):
        real = plugin.preparation.materialize
        plugin.preparation.materialize = lambda *a, real=real, **kw: made.append(a[0]) or real(*a, **kw)
    claim = ClaimRef(**await node.allocate("contended"))
    a, b = await asyncio.gather(first.prepare([claim]), second.prepare([claim]))
    assert a[claim.uid] == b[claim.uid] and a[claim.uid].error == ""
    assert made == [claim_id(claim.uid)]
