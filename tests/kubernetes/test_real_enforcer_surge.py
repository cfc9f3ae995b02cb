"""The enforcer DaemonSet's rolling update with a surge (maxSurge: 1, maxUnavailable: 0) on the real
kubelet (defect 10 of issue 22): the node is never without Tessera's DRA plugin, and no claim is lost
or prepared twice.

What the DaemonSet controller does, done here by hand on the real node (tests/kit/kubenode.py's
kubelet and containerd): the old enforcer pod runs and serves a GPU pod; the new pod (another pod
uid, so its own registration socket ``gpu.tessera.dev-<uid>-reg.sock`` and DRA socket
``dra-<uid>.sock``) starts beside it, sharing the node's host paths (the kubelet's plugin directory
with the checkpoint and its lock, the state directory with the claim directories, the CDI
directory); once it is ready (as deployed: only once the kubelet has registered it,
TESSERA_KUBELET_READY_WHEN_REGISTERED) the old pod is stopped (SIGTERM, as the kubelet stops a
container).

The kubelet (1.33+, pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go) keeps every registered
endpoint of a driver, refuses a second registration of the same endpoint, and for each call picks
the most recently registered one whose gRPC connection is up (a connected one first, else the
newest); it forgets one when its registration socket goes. It deletes the driver's ResourceSlices of
its node 30 s after the last usable endpoint went, and not while any is usable. So:

- a GPU pod created during the overlap is prepared (by the new instance) and runs;
- the first pod's deletion is unprepared by the new instance, the old one being gone: the claims it
  prepared are the new one's to unprepare (the shared checkpoint and claim directories);
- each claim is prepared exactly once, and both are released and given back at the end;
- the node's ResourceSlice is never deleted, by the kubelet (its wipe delay passes after the old
  instance stopped) nor the capacity publisher (it counts the node's plugin as registered while one
  instance says so: ``KubeletPluginStatus`` per instance, TESSERA_SLICES_NEED_PLUGIN); the slice's
  uid is the same at the end as at the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from tessera.shared.events import GpuQuota
from tessera.shared.kubeclaims import DRIVER, claim_id
from tessera.enforcer.cdi import spec_path

from gpupods import hami_pod
from kit import eventually
from kubetessera import ledgers, quota_in_use
from realpods import OUT_OF_MEMORY, TesseraOnNode, checkpoint, log_has

TENANT = "surge"
MEMORY_MIB, CORES = 1024, 30
KUBELET_WIPE_DELAY = 30.0  # seconds without a usable plugin before the kubelet deletes the driver's slices
OLD, NEW = str(uuid.uuid4()), str(uuid.uuid4())  # the two enforcer pods' uids
AS_DEPLOYED = {"TESSERA_KUBELET_READY_WHEN_REGISTERED": "true"}  # deploy/k8s/enforcer.yaml's


class SliceWatch:
    """The node's slices of the driver, looked at every second in the background: every uid seen,
    and each look that found none."""

    def __init__(self, on: TesseraOnNode, node: str) -> None:
        self.on, self.node = on, node
        self.uids: list[str] = []
        self.missing: list[float] = []

    async def slices(self) -> list[dict]:
        out = await self.on.kubectl("get", "resourceslices", "-o", "json",
                                    f"--field-selector=spec.nodeName={self.node},spec.driver={DRIVER}")
        return json.loads(out.stdout)["items"]

    async def run(self) -> None:
        while True:
            found = await self.slices()
            if not found:
                self.missing.append(time.monotonic())
            for s in found:
                if s["metadata"]["uid"] not in self.uids:
                    self.uids.append(s["metadata"]["uid"])
            await asyncio.sleep(1.0)


def registration_socket(uid: str) -> str:
    """The registration socket of the instance in pod ``uid``, as the kubelet wants them told apart."""
    return f"{DRIVER}-{uid}-reg.sock"


def registration_sockets(on: TesseraOnNode) -> set[str]:
    return {p.name for p in on.dirs.registry.iterdir() if p.is_socket()}


def prepares(logs, ref: str, cid: str) -> int:
    """How many times the enforcers' logs say they prepared the claim (answered from the checkpoint: none)."""
    line = f"prepared ResourceClaim {ref} ({cid}) for the kubelet"
    return sum(path.read_text(errors="replace").count(line) for path in logs)


async def test_a_surge_update_hands_the_node_to_the_new_enforcer_without_losing_a_claim(
        kube_cluster, kube_node, kube_namespace, nats_url, tmp_path):
    on = TesseraOnNode(kube_cluster, kube_node, kube_namespace, nats_url, tmp_path)
    node = kube_node.name
    async with on.running(TENANT, GpuQuota(gpus=2), enforcer_env={"TESSERA_POD_UID": OLD, **AS_DEPLOYED},
                          slices=True):
        old = on.cluster.find(f"enforcer-{node}")
        old_log = old.log_path
        assert registration_sockets(on) == {registration_socket(OLD)}

        # the old instance serves the first pod
        await on.kubectl("create", "-f", "-", stdin=json.dumps(hami_pod("first", kube_namespace, on.image,
                                                                         MEMORY_MIB, CORES)))
        first = await on.ready("first")
        first_claim = await on.get("resourceclaim", first["status"]["resourceClaimStatuses"][0]["resourceClaimName"])
        first_ref = f"{kube_namespace}/{first_claim['metadata']['name']}"
        first_cid = claim_id(first_claim["metadata"]["uid"])
        assert log_has(old_log, f"prepared ResourceClaim {first_ref} ({first_cid}) for the kubelet")
        [at_start] = await eventually(lambda: SliceWatch(on, node).slices(), timeout=30, what="the node's slice")

        watch = SliceWatch(on, node)
        watching = asyncio.create_task(watch.run())
        try:
            # the DaemonSet's new pod: another uid, the same host paths (the old one's state directory)
            new = on.cluster.spawn("enforcer", instance=f"enforcer-{node}-{NEW[:8]}", env={
                "TESSERA_NODE": node, **on.dirs.env(), "KUBECONFIG": str(on.identities["enforcer"]),
                "TESSERA_POD_UID": NEW, "TESSERA_STATE_DIR": str(on.cluster.state_dir(node)), **AS_DEPLOYED})
            # Ready, which is when the DaemonSet stops the old pod, only once the kubelet has the new one
            await asyncio.to_thread(on.cluster.wait_ready, 60)
            assert log_has(new.log_path, f"the kubelet registered DRA plugin {DRIVER}"), new.log_path.read_text()[-3000:]
            assert registration_sockets(on) == {registration_socket(OLD), registration_socket(NEW)}
            assert old.alive(), old.log_path.read_text()[-3000:]

            # a pod created while both serve: prepared once, by the newest registered instance
            await on.kubectl("create", "-f", "-", stdin=json.dumps(hami_pod("second", kube_namespace, on.image,
                                                                             MEMORY_MIB, CORES)))
            second = await on.ready("second")
            second_claim = await on.get("resourceclaim",
                                        second["status"]["resourceClaimStatuses"][0]["resourceClaimName"])
            second_ref = f"{kube_namespace}/{second_claim['metadata']['name']}"
            second_cid = claim_id(second_claim["metadata"]["uid"])
            assert log_has(new.log_path, f"prepared ResourceClaim {second_ref} ({second_cid}) for the kubelet"), (
                new.log_path.read_text()[-3000:])
            reply = await on.probed("second", "main")
            assert (reply["allocated_mib"], reply["stopped_by"]) == (MEMORY_MIB, OUT_OF_MEMORY), reply
            assert {first_claim["metadata"]["uid"], second_claim["metadata"]["uid"]} <= set(checkpoint(on.dirs))

            # the old pod is deleted: SIGTERM, its sockets go, the kubelet forgets its endpoint
            assert await asyncio.to_thread(on.cluster.stop_process, old) == 0, old_log.read_text()[-3000:]
            stopped = time.monotonic()
            assert registration_sockets(on) == {registration_socket(NEW)}
            assert not (on.dirs.plugin / f"dra-{OLD}.sock").exists()

            # the first pod, prepared by the old instance, is unprepared by the new one
            await on.kubectl("delete", "-n", kube_namespace, "pod/first", "--timeout=90s")
            await on.client.wait_for(first_cid, {"released"}, timeout=60)
            assert log_has(new.log_path, f"unprepared ResourceClaim {first_ref} ({first_cid})"), (
                new.log_path.read_text()[-3000:])
            assert not spec_path(kube_node.cdi_dir, first_cid).exists(), "the first pod's CDI spec outlived it"
            assert first_claim["metadata"]["uid"] not in checkpoint(on.dirs)
            # the second pod is untouched by all of it
            assert spec_path(kube_node.cdi_dir, second_cid).exists()
            assert second_claim["metadata"]["uid"] in checkpoint(on.dirs)
            assert [e for lg in (await ledgers(on.client)).values() for e in lg.entries] == [second_cid]
            assert (await on.get("pod/second"))["status"]["phase"] == "Running"

            # the kubelet's wipe delay passes with the new instance alone: the slice stays
            await eventually(lambda: time.monotonic() - stopped > KUBELET_WIPE_DELAY + 5, timeout=KUBELET_WIPE_DELAY + 60,
                             every=1.0, what="the kubelet's wipe delay after the old instance stopped")
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
        assert not watch.missing, f"the node's slice was gone {len(watch.missing)} time(s) during the update"
        assert watch.uids == [at_start["metadata"]["uid"]], f"the node's slice was written anew: {watch.uids}"
        capacity_log = on.cluster.find("capacity").log_path
        assert not log_has(capacity_log, f"the kubelet plugin of {node} is not registered"), (
            capacity_log.read_text()[-3000:])

        # the second pod goes too: unprepared by the new instance; everything is given back
        await on.kubectl("delete", "-n", kube_namespace, "pod/second", "--timeout=90s")
        await on.client.wait_for(second_cid, {"released"}, timeout=60)
        assert log_has(new.log_path, f"unprepared ResourceClaim {second_ref} ({second_cid})")
        assert await eventually(lambda: on.given_back(TENANT), timeout=30), (
            await ledgers(on.client), await quota_in_use(on.client, TENANT))
        # nothing was prepared twice, by either instance
        assert (prepares([old_log, new.log_path], first_ref, first_cid),
                prepares([old_log, new.log_path], second_ref, second_cid)) == (1, 1)
        assert not log_has(old_log, f"unprepared ResourceClaim {first_ref}")
