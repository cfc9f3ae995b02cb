"""A `Bus` on the test's own nats-server, connected and with the topology laid out.

The `bus` fixture is shaped by two small fixtures a test module or directory overrides when it
needs other values: ``bus_settings`` (stream shape: ``max_deliver``, ``ack_wait``, ...) and
``bus_service`` (whose identity lays out the topology). `open_bus` is the same for a test that needs
a second bus, or one on another server.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import pytest

from tessera.shared.bus import Bus
from tessera.shared.settings import BusSettings


@contextlib.asynccontextmanager
async def open_bus(settings: BusSettings, service: str = "test") -> AsyncIterator[Bus]:
    bus = await Bus.connect(settings, service)
    try:
        await bus.ensure_topology()
        yield bus
    finally:
        await bus.close()


@pytest.fixture
def bus_settings(nats_url) -> BusSettings:
    return BusSettings(url=nats_url)


@pytest.fixture
def bus_service() -> str:
    return "test"


@pytest.fixture
async def bus(bus_settings, bus_service) -> AsyncIterator[Bus]:
    async with open_bus(bus_settings, bus_service) as connected:
        yield connected
