"""Every service reads and checks all its settings before it connects: one run names every bad one.

Each service is started through its real entry (`runner.main` with its settings class and build)
against a NATS server that would accept it; it must stop with exit code 2, list each bad variable
(its own and a shared one), and never have connected.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tessera.capacity.service import build as capacity_build
from tessera.capacity.settings import CapacitySettings
from tessera.controlplane.__main__ import build as controlplane_build
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.enforcer.service import build as enforcer_build
from tessera.enforcer.settings import EnforcerSettings
from tessera.placement.service import build as placement_build
from tessera.placement.settings import PlacementSettings
from tessera.shared import runner
from tessera.shared.natsserver import NatsServer, free_port, wait_for_port
from tessera.translator.service import build as translator_build
from tessera.translator.settings import TranslatorSettings

# service: (its settings, its build, bad variables, what the message must say)
SERVICES = {
    "controlplane": (ControlPlaneSettings, controlplane_build, {"TESSERA_CP_CERT_DAYS": "0"},
                     ["TESSERA_CP_CERT_DAYS=0 is below the minimum 1", "TESSERA_CP_SECRET_KEY_FILE is not set"]),
    "capacity": (CapacitySettings, capacity_build,
                 {"TESSERA_PROFILE": "/nonexistent/fleet.yaml", "TESSERA_HEARTBEAT_SECONDS": "often"},
                 ["TESSERA_HEARTBEAT_SECONDS='often' is not a number", "/nonexistent/fleet.yaml"]),
    "translator": (TranslatorSettings, translator_build,
                   {"TESSERA_WEBHOOK_CERT": "/nonexistent/tls.crt", "TESSERA_KUBERNETES": "perhaps"},
                   ["TESSERA_KUBERNETES='perhaps': use true or false",
                    "set both TESSERA_WEBHOOK_CERT and TESSERA_WEBHOOK_KEY", "TESSERA_WEBHOOK_CERT=/nonexistent/tls.crt does not exist"]),
    "placement": (PlacementSettings, placement_build,
                  {"TESSERA_PLACEMENT_POLICY": "fastest", "TESSERA_PLACEMENT_BATCH": "0"},
                  ["TESSERA_PLACEMENT_POLICY='fastest': use one of", "TESSERA_PLACEMENT_BATCH=0 is below the minimum 1"]),
    "enforcer": (EnforcerSettings, enforcer_build, {"TESSERA_USAGE_SECONDS": "0"},
                 ["TESSERA_NODE is not set: name the node this enforcer runs on",
                  "TESSERA_USAGE_SECONDS=0 must be more than 0"]),
}


def client_names(server: NatsServer) -> list[str]:
    """Names of every client connection the server has seen, open or closed (its /connz)."""
    wait_for_port(server.monitor_port, 20)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/connz?state=all", timeout=5) as reply:
        return [c.get("name", "") for c in json.load(reply).get("connections") or []]


@pytest.mark.parametrize("service", SERVICES)
def test_bad_settings_stop_a_service_before_it_connects(service, tmp_path, capsys):
    settings_class, build, bad, expected = SERVICES[service]
    with NatsServer(tmp_path / "nats", monitor_port=free_port()) as server:
        env = {"TESSERA_NATS_URL": server.url, "TESSERA_METRICS_PORT": "70000", **bad}
        assert runner.main(service, settings_class, build, env=env) == 2
        message = capsys.readouterr().err
        assert message.startswith(f"tessera-{service}: {len(expected) + 1} settings are wrong:"), message
        for line in expected + ["TESSERA_METRICS_PORT=70000 is out of range; use 0 to 65535"]:
            assert line in message, message
        assert "Traceback" not in message
        assert f"tessera-{service}" not in client_names(server)  # (the server's own port probe has no name)
