"""The enforcer refuses to start without a usable TESSERA_NODE, before it looks for NATS.

Its settings are read before anything connects, so the message comes at once whether or not NATS
is there; here nothing listens on the NATS port at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.shared.natsserver import free_port

ENFORCER = str(Path(sys.executable).parent / "tessera-enforcer")


@pytest.mark.parametrize("node, message", [
    (None, "TESSERA_NODE is not set: name the node this enforcer runs on"),
    ("", "TESSERA_NODE is not set: name the node this enforcer runs on"),
    ("gpu node 1", "TESSERA_NODE='gpu node 1' cannot be a node name: use letters, digits, '.', '-' and '_'"),
    ("*", "TESSERA_NODE='*' is the wildcard of every node; name this one node"),
])
def test_an_enforcer_without_a_usable_node_stops_naming_it_with_no_nats_running(node, message, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env.update(TESSERA_NATS_URL=f"nats://127.0.0.1:{free_port()}", TESSERA_STATE_DIR=str(tmp_path / "state"))
    if node is not None:
        env["TESSERA_NODE"] = node
    run = subprocess.run([ENFORCER], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == f"tessera-enforcer: {message}"
    assert not (tmp_path / "state").exists()
