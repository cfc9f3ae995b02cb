"""What the CDI tests share: an enforcer's Preparation on a simulated node, its state under tmp_path."""

from __future__ import annotations

import pytest

from tessera.enforcer import cdi
from tessera.enforcer.claimdir import ClaimDirs
from tessera.enforcer.preparation import Preparation
from tessera.enforcer.settings import EnforcerSettings


@pytest.fixture
def preparation(tmp_path):
    sim = tmp_path / "sim"
    sim.mkdir()
    for lib in cdi.SIM_DRIVER_LIBS:
        (sim / lib).write_bytes(b"\x7fELF")
    settings = EnforcerSettings.from_env({"TESSERA_NODE": "n1", "TESSERA_STATE_DIR": str(tmp_path / "state"),
                                          "TESSERA_SIM_DRIVER_DIR": str(sim)})
    return Preparation(settings, ClaimDirs(settings.state_dir))
