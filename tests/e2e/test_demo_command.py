"""`tessera demo`, the scenario `make up` shows, runs to the end, exits 0 and leaves no process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def processes_started_under(workdir: Path) -> list[int]:
    """PIDs whose environment points into ``workdir`` (the services a run started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"TESSERA_STATE_DIR={workdir}".encode() in environ:
            found.append(int(entry.name))
    return found


def test_demo_runs_the_scenario_to_the_end_and_cleans_up(tmp_path):
    env = dict(os.environ, COLUMNS="200")
    env.pop("TESSERA_NATS_URL", None)
    run = subprocess.run(
        [str(Path(sys.executable).parent / "tessera"), "demo", "--workdir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "demo summary" in run.stdout
    assert "all released, ledger entries left: 0" in " ".join(run.stdout.split())
    assert "unschedulable" in run.stdout and "tenant quota exceeded" in " ".join(run.stdout.split())
    assert processes_started_under(tmp_path) == []
    # The embedded server runs with authorization: one user per service, each tenant its own account.
    config = (tmp_path / "nats-auth" / "nats.conf").read_text()
    assert all(f'"user": "{name}"' in config for name in ("operator", "controlplane", "enforcer-a100-0"))
    accounts = (tmp_path / "nats-auth" / "tenants.conf").read_text()
    assert "TENANT_vision:" in accounts and "TENANT_nlp:" in accounts
