"""Claim events name their node, so each enforcer hears only its own node's events.

At fleet scale this is the difference between one delivery per event and one per node. A release
that names no node (published by a tenant directly) is passed on by placement to the node that
holds the claim; a release of another tenant's claim is refused, not carried out.
"""

from __future__ import annotations

import asyncio

from tessera.shared import api, subjects
from tessera.shared.events import ClaimReleaseRequested, dlq_decoder

from tessera.cli.client import Client

from kit import eventually
from runkit import create_tenant


async def delivered(client: Client, node: str) -> int:
    info = await client.bus.consumer_info(subjects.STREAM_CLAIMS, f"enforcer-{node}")
    return info.delivered.consumer_seq


async def submit_on(client: Client, node: str, tenant: str = "alpha") -> str:
    reply = await client.submit(api.SubmitRequest(tenant=tenant, resources={"nvidia.com/gpumem": 500}, node=node))
    await client.wait_for(reply["claim"], {"prepared"}, timeout=60)
    return reply["claim"]


async def test_an_enforcer_receives_only_the_events_of_its_own_node(cluster):
    client = await Client.connect(cluster.url)
    try:
        before = {n: await delivered(client, n) for n in ("gpu-0", "gpu-1")}
        claim = await submit_on(client, "gpu-1")
        await client.release(claim)
        await client.wait_for(claim, {"released"}, timeout=60)
        assert await delivered(client, "gpu-0") == before["gpu-0"]  # not one message of gpu-1's claim
        assert await delivered(client, "gpu-1") >= before["gpu-1"] + 2  # its allocated and its release
    finally:
        await client.close()


async def test_a_release_that_names_no_node_is_passed_on_to_the_node_of_the_claim(cluster):
    client = await Client.connect(cluster.url)
    try:
        claim = await submit_on(client, "gpu-1")
        # As a tenant may publish it: straight onto the stream, no node, the record not marked.
        await client.bus.publish(subjects.claim("alpha", claim, "release"),
                                 ClaimReleaseRequested(claim=claim, tenant="alpha", reason="done"))
        record = await client.wait_for(claim, {"released"}, timeout=60)
        assert record.reason == "done" and record.node == "gpu-1"
    finally:
        await client.close()


async def test_a_release_of_another_tenants_claim_is_refused_and_the_claim_kept(cluster):
    await create_tenant(cluster.url, "beta")
    client = await Client.connect(cluster.url)
    try:
        theirs = await submit_on(client, "gpu-0", tenant="beta")
        # Alpha may publish only under its own name: it names beta's claim there.
        await client.bus.publish(subjects.claim("alpha", theirs, "release"),
                                 ClaimReleaseRequested(claim=theirs, tenant="alpha", reason="stolen"))

        async def refused():
            info = await client.bus.stream_info(subjects.STREAM_DLQ)
            for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
                letter = dlq_decoder.decode((await client.bus.stored_message(subjects.STREAM_DLQ, seq)).data)
                if f".{theirs}." in letter.subject:
                    return letter
            return None

        letter = await eventually(refused, timeout=30, what="a dead letter for the foreign release")
        assert letter.service == "placement" and "not theirs" in letter.reason
        await asyncio.sleep(0.5)  # give a wrongly forwarded release time to act
        assert (await client.claim(theirs)).state == "prepared"
        await client.release(theirs)
        await client.wait_for(theirs, {"released"}, timeout=60)
    finally:
        await client.close()
