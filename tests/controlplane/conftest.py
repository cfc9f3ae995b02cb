"""Fixtures for the control-plane manager: a Bus on the test's own nats-server, a manager in-loop,
and managers whose tenants' control planes really run (``planes``; ``kube_mode`` on the session's
real Kubernetes control plane, tests/kit/kubecluster.py)."""

from __future__ import annotations

import msgspec
import pytest


from tessera.controlplane.app import Manager
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared import api, subjects
from tessera.shared.bus import Bus
from tessera.shared.settings import BusSettings

from kit import open_bus
from controlplane.planes import PLATFORM, secured_nats_server
from controlplane.planes import binaries, kube_mode, planes  # noqa: F401 - fixtures, registered by being here


@pytest.fixture
def bus_settings(nats_url) -> BusSettings:
    """The kit's `bus` (tests/kit/bus.py), as the manager's: memory storage, its topology."""
    return BusSettings(url=nats_url, file_storage=False)


@pytest.fixture
def bus_service() -> str:
    return "controlplane"


async def call(bus: Bus, verb: str, payload: dict | bytes) -> api.Reply:
    data = payload if isinstance(payload, bytes) else msgspec.json.encode(payload)
    return api.decode_reply(await bus.request(f"{subjects.API_TENANTS}.{verb}", data, timeout=20))


@pytest.fixture
def call_api():
    return call


@pytest.fixture
def secured_nats(tmp_path):
    server, users, pid = secured_nats_server(tmp_path)
    try:
        yield server, users, pid
    finally:
        server.stop()


@pytest.fixture
async def platform_bus(secured_nats):
    server, _, _ = secured_nats
    url = f"nats://{PLATFORM[0]}:{PLATFORM[1]}@127.0.0.1:{server.port}"
    async with open_bus(BusSettings(url=url, file_storage=False), "controlplane") as bus:
        yield bus


@pytest.fixture
def secured_settings(secured_nats, tmp_path) -> ControlPlaneSettings:
    _, users, pid = secured_nats
    return ControlPlaneSettings(
        nats_auth_file=str(users), nats_pid_file=str(pid), host_mode="render",
        manifests_dir=str(tmp_path / "manifests"),
    )


@pytest.fixture
async def manager(platform_bus, secured_settings):
    mgr = await Manager.start(platform_bus, secured_settings)
    try:
        yield mgr
    finally:
        await mgr.close()
