"""What the kubelet plugin answers is what a container runtime runs: the CDI id from
NodePrepareResources, given to Podman, makes a container whose CUDA allocations stop at the claim's
limit; after NodeUnprepareResources the id no longer resolves.

The enforcer runs as its own process in Kubernetes mode (tests/enforcer/kubeletkit.py: a real
nats-server, the kubelet's calls over the real unix sockets) and reads the claim from the session's
real kube-apiserver as its DaemonSet's pod on the node; the claim is the resourceclaim controller's,
allocated as placement would.
"""

from __future__ import annotations

import asyncio
import json

from kubeletkit import Kubelet, PluginNode
from runtime import Podman

PROBE = "/usr/local/bin/cuda_probe"
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


async def test_the_plugins_cdi_id_runs_a_container_limited_to_the_claim(
        nats_server, tmp_path, kube_plane, plane_namespace, tools, base_image, cuda_probe):
    node = await asyncio.to_thread(PluginNode, nats_url=nats_server.url, workdir=tmp_path, plane=kube_plane,
                                   namespace=plane_namespace)
    kubelet = Kubelet(node.registry_dir)
    try:
        await node.start()
        await kubelet.register()
        claim = await node.allocate("trainer", devices=((0, 1024, 30),))
        reply = (await kubelet.prepare(claim))[claim["uid"]]
        assert reply.error == ""
        (device,) = [cdi for d in reply.devices for cdi in d.cdi_device_ids]
        node.spec(claim)  # valid by the CDI specification's schema
        podman = Podman(cdi_dir=node.cdi_dir, tools=tools)
        args = podman.run_args(base_image, device, mounts={str(cuda_probe): PROBE})

        ran = await asyncio.to_thread(podman, *args, PROBE, "64", "0")
        assert ran.code == 0, ran.stderr[-2000:]
        got = json.loads(ran.stdout.strip().splitlines()[-1])
        assert (got["allocated_mib"], got["stopped_by"], got["one_more_byte"]) == (1024, OUT_OF_MEMORY, OUT_OF_MEMORY)

        assert (await kubelet.unprepare(claim))[claim["uid"]].error == ""
        refused = await asyncio.to_thread(podman, *args, PROBE, "64", "0")
        assert refused.code != 0 and f"unresolvable CDI devices {device}" in refused.stderr, refused.stderr
    finally:
        await kubelet.close()
        await node.close()
