"""The plugin says whether the kubelet has it registered (what the capacity publisher's slices
follow): registered once the kubelet's NotifyRegistrationStatus says so, not when it refuses, not
once its registration socket is gone, and not when it stops; while registered, again and again, so
that its silence means it died. Over the real sockets, the kubelet's calls made by this test."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import grpc

from tessera.shared.events import KubeletPluginStatus
from tessera.shared.kubeclaims import DRIVER

from tessera.enforcer.kubelet.api import pluginregistration_v1_pb2 as reg_pb2
from tessera.enforcer.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from tessera.enforcer.kubelet.registration import PluginRegistration
from tessera.enforcer.kubelet.server import serve, socket_names

from kit import eventually


async def notify(socket: Path, registered: bool, error: str = "") -> None:
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        await stub.GetInfo(reg_pb2.InfoRequest(), timeout=10)
        await stub.NotifyRegistrationStatus(reg_pb2.RegistrationStatus(plugin_registered=registered, error=error),
                                            timeout=10)


async def test_the_plugin_says_what_the_kubelet_made_of_it_and_that_it_stopped():
    root = Path(tempfile.mkdtemp(prefix="reg-", dir="/tmp"))  # unix socket paths are short
    registry, plugin_dir = root / "plugins_registry", root / "plugins" / DRIVER
    said: list[KubeletPluginStatus] = []

    async def publish(status: KubeletPluginStatus) -> None:
        said.append(status)

    registration = PluginRegistration("gpu-0", "pod-1", publish, report_seconds=0.05)
    ready = asyncio.Event()
    serving = asyncio.create_task(serve(None, registry, plugin_dir, ready.set, registration=registration))  # type: ignore[arg-type]
    reporting = asyncio.create_task(registration.report())
    socket = registry / socket_names()[0]
    try:
        await asyncio.wait_for(ready.wait(), 30)
        await eventually(lambda: bool(said), timeout=10)
        assert not said[-1].registered and "has not registered" in said[-1].reason

        await notify(socket, False, "no such version")
        await eventually(lambda: "refused to register it: no such version" in said[-1].reason, timeout=10)
        await notify(socket, True)
        await eventually(lambda: said[-1].registered, timeout=10, what="registered")
        assert (said[-1].node, said[-1].instance, said[-1].reason) == ("gpu-0", "pod-1", "registered by the kubelet")
        count = len(said)
        await eventually(lambda: len(said) >= count + 3, timeout=10, what="said again while registered")
        assert all(s.registered for s in said[count:])

        socket.unlink()  # gone (someone removed it): the kubelet unregisters the plugin
        await eventually(lambda: not said[-1].registered, timeout=10, what="unregistered")
        assert "registration socket" in said[-1].reason

        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        assert (said[-1].registered, said[-1].reason) == (False, "the plugin stopped")
    finally:
        for task in (serving, reporting):
            task.cancel()
        await asyncio.gather(serving, reporting, return_exceptions=True)


async def test_the_registration_opens_readiness_only_once_the_kubelet_has_registered_the_plugin():
    # A rolling update stops the old instance once the new pod is Ready: ready only when the kubelet
    # has the new one, not when its sockets merely listen, nor when the kubelet refused it.
    root = Path(tempfile.mkdtemp(prefix="reg-", dir="/tmp"))
    registry, plugin_dir = root / "plugins_registry", root / "plugins" / DRIVER
    opened: list[bool] = []

    async def publish(status: KubeletPluginStatus) -> None:
        pass

    registration = PluginRegistration("gpu-0", "pod-1", publish, on_registered=lambda: opened.append(True))
    listening = asyncio.Event()
    serving = asyncio.create_task(serve(None, registry, plugin_dir, listening.set, registration=registration))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(listening.wait(), 30)
        socket = registry / socket_names()[0]
        await notify(socket, False, "no such version")
        assert opened == []
        await notify(socket, True)
        assert opened == [True]
        await notify(socket, True)  # said again: opened once
        assert opened == [True]
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
