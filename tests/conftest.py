"""Fixtures every test group shares: a private nats-server per test, and a connected Bus.

Each test that needs NATS gets its own server on a free port with a temporary store, so tests never
see each other's streams and a test may kill or restart its server freely.
"""

from __future__ import annotations

import pytest

from tessera.shared.natsserver import NatsServer


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url
