"""A released claim keeps its ledger entry until its processes are gone.

A claim's GPU memory is in use for as long as a process of the claim lives, whatever its record
says: the ledger entry that stands for it must outlive the process, or the GPU is sold again while
it is still occupied (the over-commit preemption must never cause). On a release request the
enforcer sends the claim's processes SIGTERM, waits the grace period, SIGKILLs what is left, and
only once the kernel says they are gone removes the entry and publishes ``released``.

Watched from outside, as any tool could: every revision of the node's ledger key (a core
subscription to the bucket's subject) is checked against the process's liveness when it arrives.
A process alive when a revision without its entry is seen was alive at that revision.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tessera.shared import api
from tessera.shared.events import ClaimRecord

from tessera.cli.client import Client

from runkit import LedgerRevisions, Revision, start_workload

NODE = "gpu-1"


@dataclass
class Released:
    record: ClaimRecord  # as it ended
    code: int  # the workload's exit status
    removal: Revision  # the first ledger revision without the claim
    seen: list[Revision]  # every revision seen


async def release_workload(client: Client, tmp_path, on_term: str, reason: str) -> Released:
    """A reservation on NODE, its workload started (``on_term``), then the claim released."""
    claim = (await client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": 500},
                                                   node=NODE)))["claim"]
    await client.wait_for(claim, {"prepared"}, timeout=60)
    workload = await start_workload(client, claim, tmp_path, on_term=on_term)
    async with LedgerRevisions(client, NODE, [workload]) as revisions:
        await client.release(claim, reason=reason)
        record = await client.wait_for(claim, {"released"}, timeout=60)
        code = await asyncio.wait_for(workload.proc.wait(), 60)
        removal = await revisions.removal(claim)
    return Released(record, code, removal, revisions.seen)


async def test_a_released_claim_keeps_its_ledger_entry_until_its_process_is_killed(cluster, tmp_path):
    client = await Client.connect(cluster.url)
    try:
        done = await release_workload(client, tmp_path, "ignore", "test: stop it")
        claim = done.record.claim
        assert claim not in done.removal.alive, \
            f"the ledger gave {claim}'s GPU memory back while its process lived: {done.seen}"
        assert claim in done.removal.termed  # SIGTERM first ...
        assert done.code == -9  # ... ignored, so SIGKILL once the grace period was over
        assert done.record.reason == "test: stop it"
    finally:
        await client.close()


async def test_a_process_that_stops_on_sigterm_is_given_its_grace_period(cluster, tmp_path):
    client = await Client.connect(cluster.url)
    try:
        done = await release_workload(client, tmp_path, "exit", "requested")
        claim = done.record.claim
        assert claim not in done.removal.alive and claim in done.removal.termed, done.seen
        assert done.code == 0  # it stopped by itself on SIGTERM: never SIGKILLed
    finally:
        await client.close()
