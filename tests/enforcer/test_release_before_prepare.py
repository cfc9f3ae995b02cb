"""A claim released before its node's enforcer got to it is released, never prepared.

The enforcer of gpu-1 is paused (SIGSTOP) while a claim is allocated there and then released; when
it resumes it reads the ``allocated`` event first, finds the release request on the claim's record,
and releases it at once: no claim directory, no ``prepared`` event, capacity back in the ledger.
"""

from __future__ import annotations

import os
import signal

from tessera.shared import api, subjects

from tessera.cli.client import Client

from kit import eventually
from runkit import live_entries


async def _gone(client: Client, claim: str) -> bool:
    return claim not in await live_entries(client)


async def test_a_claim_released_before_it_was_prepared_is_released_not_prepared(cluster):
    client = await Client.connect(cluster.url)
    enforcer = cluster.find("enforcer-gpu-1").proc
    prepared = []

    async def on_prepared(msg):
        prepared.append(msg.subject)

    sub = await client.bus.listen(subjects.claims_of_kind("prepared"), on_prepared)
    os.kill(enforcer.pid, signal.SIGSTOP)
    try:
        claim = (await client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": 500},
                                                       node="gpu-1")))["claim"]
        await client.wait_for(claim, {"allocated"})
        await client.release(claim)
        assert (await client.claim(claim)).release_requested
    finally:
        os.kill(enforcer.pid, signal.SIGCONT)
    try:
        record = await client.wait_for(claim, {"released"}, timeout=60)
        assert record.reason
        # (the ledger entry goes last of a release, just after the record says ``released``)
        await eventually(lambda: _gone(client, claim), what=f"{claim} out of the ledger")
        assert not [s for s in prepared if f".{claim}." in s]
        assert not (cluster.workdir / "state" / "enforcer-gpu-1" / "claims" / claim).exists()
    finally:
        await sub.unsubscribe()
        await client.close()
