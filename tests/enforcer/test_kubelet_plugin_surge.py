"""A rolling update with a surge: two instances of the plugin on one node at once (the DaemonSet's
maxSurge: 1). Each names its sockets after its pod uid, as the kubelet (1.33+) expects, so the new
one registers beside the old one, and the old one leaving removes only its own sockets. With the
fixed names (today's before the change) the second instance unlinked the first one's sockets."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import grpc
import pytest

from tessera.shared.kubeclaims import DRIVER
from tessera.shared.settings import SettingsError

from tessera.enforcer.kubelet.api import pluginregistration_v1_pb2 as reg_pb2
from tessera.enforcer.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from tessera.enforcer.kubelet.server import serve, socket_names
from tessera.enforcer.settings import EnforcerSettings

OLD, NEW = "11111111-1111-4111-8111-111111111111", "22222222-2222-4222-8222-222222222222"


async def info(socket: Path) -> reg_pb2.PluginInfo:
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        return await reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest(), timeout=10)


async def test_two_instances_serve_side_by_side_and_each_leaves_alone():
    root = Path(tempfile.mkdtemp(prefix="surge-", dir="/tmp"))  # unix socket paths are short
    registry, plugin_dir = root / "plugins_registry", root / "plugins" / DRIVER
    started = {OLD: asyncio.Event(), NEW: asyncio.Event()}
    tasks = {uid: asyncio.create_task(serve(None, registry, plugin_dir, started[uid].set, uid))  # type: ignore[arg-type]
             for uid in (OLD, NEW)}
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 30)
        assert sorted(p.name for p in registry.iterdir()) == sorted(
            [f"{DRIVER}-{OLD}-reg.sock", f"{DRIVER}-{NEW}-reg.sock"])
        for uid in (OLD, NEW):
            got = await info(registry / socket_names(uid)[0])
            assert got.name == DRIVER and got.endpoint == str(plugin_dir / f"dra-{uid}.sock")

        tasks[OLD].cancel()  # the old pod stops (SIGTERM): its sockets go, the new one's stay
        await asyncio.gather(tasks[OLD], return_exceptions=True)
        assert [p.name for p in registry.iterdir()] == [f"{DRIVER}-{NEW}-reg.sock"]
        assert [p.name for p in plugin_dir.iterdir() if p.is_socket()] == [f"dra-{NEW}.sock"]
        assert (await info(registry / socket_names(NEW)[0])).endpoint.endswith(f"dra-{NEW}.sock")
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


def test_without_a_uid_the_names_are_the_fixed_ones():
    assert socket_names("") == (f"{DRIVER}-reg.sock", "dra.sock")


@pytest.mark.parametrize("bad", ["../../etc", "not-a-uid", OLD + "x"])
def test_a_pod_uid_that_is_not_one_is_refused(bad):
    with pytest.raises(SettingsError, match="TESSERA_POD_UID.*metadata.uid"):
        EnforcerSettings.from_env({"TESSERA_POD_UID": bad, "TESSERA_NODE": "gpu-0", "TESSERA_NATS_URL": "nats://127.0.0.1:4222"})


def kubernetes_settings(**env: str) -> EnforcerSettings:
    return EnforcerSettings.from_env({"TESSERA_KUBERNETES": "true", "TESSERA_NODE": "gpu-0",
                                      "TESSERA_NATS_URL": "nats://127.0.0.1:4222", **env})


def test_the_deployed_directories_fit_a_sockets_path_with_a_pod_uid():
    # /var/lib/kubelet/plugins_registry/gpu.tessera.dev-<uid>-reg.sock: 95 bytes of the 107
    settings = kubernetes_settings(TESSERA_POD_UID=OLD)
    assert settings.kubelet_registry_dir == Path("/var/lib/kubelet/plugins_registry")


def test_kubelet_directories_too_deep_for_sockets_with_the_pod_uid_are_refused_by_name():
    # microk8s's kubelet root: with a pod uid its sockets' paths are 120 and 111 bytes, which neither
    # end of a unix socket can use (gRPC said only "Failed to bind to address")
    deep = "/var/snap/microk8s/common/var/lib/kubelet"
    env = {"TESSERA_KUBELET_REGISTRY_DIR": f"{deep}/plugins_registry",
           "TESSERA_KUBELET_PLUGIN_DIR": f"{deep}/plugins/{DRIVER}"}
    with pytest.raises(SettingsError) as refused:
        kubernetes_settings(TESSERA_POD_UID=OLD, **env)
    text = str(refused.value)
    assert f"TESSERA_KUBELET_REGISTRY_DIR={deep}/plugins_registry" in text and "13 bytes too long" in text, text
    assert f"TESSERA_KUBELET_PLUGIN_DIR={deep}/plugins/{DRIVER}" in text and "4 bytes too long" in text, text
    assert "TESSERA_POD_UID" in text, text  # what to do instead: the fixed names, without a surge
    kubernetes_settings(**env)  # the fixed names fit (37 bytes shorter)
