"""A tenant's kine on NATS that crashes, or sleeps, comes back: the consumers a dead kine leaves behind
are freed before its successor starts, and do not use up its account's consumer limit.

kine watches its bucket through an ordered consumer, an ephemeral that the server removes only once
it has been inactive for a while. A kine that is killed (or stopped by sleep) leaves its consumer
behind; its successor makes another. The tenant's account allows 32 (`TenantLimits.max_consumers`):
seen in the 30-tenant benchmark, a tenant whose kine had been restarted a few times under load could
not wake ("maximum consumers limit reached", err_code 10026), and every restart that failed left one
more behind.
"""

from __future__ import annotations

import os
import signal

import pytest

from controlplane.planes import Planes
from kit import eventually
from tessera.controlplane.datastores import natskv
from tessera.shared.identities import TenantLimits

RESTARTS = 3


async def consumer_names(planes: Planes, name: str) -> set[str]:
    """The consumers on the tenant's bucket, as its own datastore user lists them."""
    nc = await natskv.connect_tenant(await planes.credentials(name))
    try:
        return {c.name for c in await nc.jetstream().consumers_info(f"KV_{natskv.bucket_name(name)}")}
    finally:
        await nc.close()


async def kill_kine(planes: Planes, name: str) -> set[str]:
    """SIGKILL the tenant's kine, wait until the one started in its place watches the bucket; what the
    killed one held that is still there."""
    held = await consumer_names(planes, name)
    pid = planes.host.pids(name)["datastore-shim"]
    os.kill(pid, signal.SIGKILL)
    await eventually(lambda: planes.host.pids(name).get("datastore-shim") not in (None, pid), timeout=60,
                     what=f"a new kine for {name}")
    now = await eventually(lambda: consumer_names(planes, name), timeout=60, what=f"the new kine of {name} to watch")
    return held & now


@pytest.mark.timeout(900)
@pytest.mark.parametrize("planes", ["nats"], indirect=True)
async def test_a_killed_kines_consumers_are_freed_before_its_successor_starts(planes: Planes, tmp_path):
    await planes.create("crashy")
    await planes.create("steady")
    for restart in range(RESTARTS):
        left = await kill_kine(planes, "crashy")
        assert not left, f"restart {restart + 1}: the killed kine's consumers are still there: {sorted(left)}"
    await planes.wait_phase("crashy", "Ready")
    got = await planes.kubectl(await planes.kubeconfig("crashy", tmp_path), "get", "ns")
    assert got.returncode == 0, got.stderr
    # a kine whose API server re-watches from its last revisions holds a consumer per watch for a while
    assert len(await consumer_names(planes, "crashy")) < TenantLimits().max_consumers
    assert (await planes.record("steady")).status.phase == "Ready"  # type: ignore[union-attr]
