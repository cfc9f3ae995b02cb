"""The kubelet plugin's two gRPC servers on unix sockets: registration and the DRA service.

The kubelet's plugin watcher finds ``gpu.tessera.dev-reg.sock`` in its registry directory, asks
``GetInfo`` (type DRAPlugin, the driver name, the DRA socket, the DRA service versions served) and
reports back with ``NotifyRegistrationStatus``; from then on it calls NodePrepareResources and
NodeUnprepareResources on the DRA socket in the plugin directory. Both DRA versions the kubelet
speaks (v1, and v1beta1 for older kubelets) are served by one implementation (plugin.py). The DRA
socket is listening before the registration socket appears, and both sockets are removed on the
way out, so the kubelet never registers a plugin that cannot answer, and sees it leave. What the
kubelet says of the registration, and its calls, go to `registration.PluginRegistration`, which
tells the capacity publisher (a node's ResourceSlices exist only while its plugin is registered).

Rolling updates with a surge (the DaemonSet's maxSurge: 1): given its pod's uid, each instance's
sockets carry it (``gpu.tessera.dev-<uid>-reg.sock``, ``dra-<uid>.sock``; sockets.py), the names the kubelet (1.33+)
expects of two instances of one driver side by side; it may call either, and the plugin's node-wide
lock and checkpoint (plugin.py) make that safe. Without a uid the names are the fixed ones.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Callable

import grpc

from tessera.shared.kubeclaims import DRIVER

from tessera.enforcer.kubelet.api import (
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_v1_pb2 as registration_pb2,
    pluginregistration_v1_pb2_grpc as registration_pb2_grpc,
)
from tessera.enforcer.kubelet.health import DeviceHealth
from tessera.enforcer.kubelet.plugin import ClaimRef, DraPlugin
from tessera.enforcer.kubelet.registration import PluginRegistration
from tessera.enforcer.kubelet.sockets import socket_names

log = logging.getLogger("tessera.enforcer.kubelet")

PLUGIN_TYPE = "DRAPlugin"

# The gRPC services the kubelet may call, as it names them in supported_versions: the DRA service
# in both versions, and the device-health stream (a 1.37 kubelet opens it only if it is named here;
# 1.36 opens it regardless, and ignores names it does not know).
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
STOP_GRACE_SECONDS = 2.0


class Registration(registration_pb2_grpc.RegistrationServicer):
    def __init__(self, endpoint: Path, registration: PluginRegistration | None = None) -> None:
        self.endpoint = endpoint
        self.registration = registration

    async def GetInfo(self, request, context):  # noqa: N802 - the gRPC method's name
        return registration_pb2.PluginInfo(type=PLUGIN_TYPE, name=DRIVER, endpoint=str(self.endpoint),
                                           supported_versions=list(SUPPORTED_VERSIONS))

    async def NotifyRegistrationStatus(self, request, context):  # noqa: N802
        if request.plugin_registered:
            log.info("the kubelet registered DRA plugin %s (endpoint %s)", DRIVER, self.endpoint)
        else:
            log.error("the kubelet refused to register DRA plugin %s: %s", DRIVER, request.error or "no reason given")
        if self.registration is not None:
            self.registration.notified(request.plugin_registered, request.error)
        return registration_pb2.RegistrationStatusResponse()


def _refs(request) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in request.claims]


class _DraService:
    """NodePrepareResources / NodeUnprepareResources for one version's generated messages."""

    pb2 = dra_v1_pb2
    has_share_id = True

    def __init__(self, plugin: DraPlugin, registration: PluginRegistration | None = None) -> None:
        self.plugin = plugin
        self.registration = registration

    def _called(self, what: str) -> None:
        if self.registration is not None:
            self.registration.called(what)

    async def NodePrepareResources(self, request, context):  # noqa: N802
        self._called("NodePrepareResources")
        results = await self.plugin.prepare(_refs(request))
        reply = self.pb2.NodePrepareResourcesResponse()
        for uid, result in results.items():
            one = reply.claims[uid]
            if result.error:
                one.error = result.error
                continue
            for d in result.devices:
                device = one.devices.add(request_names=d.request_names, pool_name=d.pool, device_name=d.device,
                                         cdi_device_ids=d.cdi_ids)
                if self.has_share_id and d.share_id:
                    device.share_id = d.share_id
        return reply

    async def NodeUnprepareResources(self, request, context):  # noqa: N802
        self._called("NodeUnprepareResources")
        errors = await self.plugin.unprepare(_refs(request))
        reply = self.pb2.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            reply.claims[uid].error = error
        return reply


class DraV1(_DraService, dra_v1_pb2_grpc.DRAPluginServicer):
    pass


class DraV1beta1(_DraService, dra_v1beta1_pb2_grpc.DRAPluginServicer):
    pb2 = dra_v1beta1_pb2
    has_share_id = False


async def _listen(server: grpc.aio.Server, socket: Path) -> None:
    socket.parent.mkdir(parents=True, exist_ok=True)
    socket.unlink(missing_ok=True)  # a socket left by a killed predecessor: listen anew
    server.add_insecure_port(f"unix://{socket}")
    await server.start()


async def serve(plugin: DraPlugin, registry_dir: Path, plugin_dir: Path, ready: Callable[[], None],
                pod_uid: str = "", health: DeviceHealth | None = None,
                registration: PluginRegistration | None = None) -> None:
    """Serve until cancelled: the DRA socket first (with the device-health stream, given ``health``),
    then the registration socket; ``registration`` hears what the kubelet says and does."""
    registration_name, dra_name = socket_names(pod_uid)
    dra_socket, registration_socket = plugin_dir / dra_name, registry_dir / registration_name
    dra = grpc.aio.server()
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(DraV1(plugin, registration), dra)
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(DraV1beta1(plugin, registration), dra)
    if health is not None:
        dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(health, dra)
    registrar = grpc.aio.server()
    registration_pb2_grpc.add_RegistrationServicer_to_server(Registration(dra_socket, registration), registrar)
    try:
        await _listen(dra, dra_socket)
        await _listen(registrar, registration_socket)
        if registration is not None:
            registration.listening(registration_socket)
        log.info("kubelet plugin %s: registration on %s, DRA (%s) on %s", DRIVER, registration_socket,
                 ", ".join(SUPPORTED_VERSIONS), dra_socket)
        ready()
        await asyncio.Event().wait()
    finally:
        registration_socket.unlink(missing_ok=True)  # first: the kubelet sees the plugin go
        stopping = [registrar.stop(STOP_GRACE_SECONDS), dra.stop(STOP_GRACE_SECONDS)]
        if registration is not None:  # and the capacity publisher hears it
            stopping.append(registration.stopped())
        await asyncio.gather(*stopping)
        dra_socket.unlink(missing_ok=True)
