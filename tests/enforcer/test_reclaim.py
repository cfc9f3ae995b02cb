"""Leaks are reclaimed within a bounded time, and nothing in use is released.

A `tessera run` killed with SIGKILL cannot release its claim: the enforcer sees its owner lock drop,
kills what the workload left behind and releases the claim. An enforcer killed with SIGKILL and
started again from empty memory adopts the workloads that still run and releases the orphans.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from tessera.cli.client import Client

from kit import eventually
from runkit import WORKLOAD, finish, live_entries, run_claims, start_run


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def read_report(proc) -> dict:
    import json

    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    return json.loads(line)


async def new_run_claim(client: Client, known: set[str]) -> str:
    async def find():
        fresh = [c for c, s in (await run_claims(client)).items() if c not in known and s == "running"]
        return fresh[0] if fresh else None

    return await eventually(find, what="a new running claim")


async def released_as_orphan(client: Client, claim: str, what: str) -> None:
    """Wait until ``claim`` is released and out of the ledger; its reason says its owner is gone."""
    async def reclaimed():
        return (await client.claim(claim)).state == "released" and claim not in await live_entries(client)

    await eventually(reclaimed, what=what)
    assert "owner gone" in (await client.claim(claim)).reason


async def live_claim_kept_then_released(client: Client, live, claim: str, hold_file) -> None:
    """The live workload's claim survived the reclaim; letting the workload finish releases it."""
    assert (await client.claim(claim)).state == "running"
    assert claim in await live_entries(client)
    hold_file.touch()
    done = await finish(live)
    assert done.code == 0, done.stderr
    assert (await client.claim(claim)).state == "released"


async def test_killed_tessera_run_is_reclaimed_and_its_leftovers_killed_while_a_live_claim_stays(cluster, tmp_path):
    client = await Client.connect(cluster.url)
    try:
        known = set(await run_claims(client))
        live = await start_run(cluster, "--gpumem", "500", workload=["--alloc", "100", "--hold-file", str(tmp_path / "live")])
        live_claim = await new_run_claim(client, known)
        # The workload runs under a shell, so the kernel's parent-death signal reaches only the shell:
        # the python process it started is left behind holding GPU memory.
        script = f"{sys.executable} {WORKLOAD} --alloc 200 --hold-file {tmp_path / 'never'} & wait"
        doomed = await start_run(cluster, "--gpumem", "500", command=["sh", "-c", script])
        doomed_claim = await new_run_claim(client, known | {live_claim})
        leftover = (await read_report(doomed))["pid"]
        assert alive(leftover)

        doomed.kill()  # SIGKILL: `tessera run` gets no chance to release
        await doomed.wait()

        await released_as_orphan(client, doomed_claim, "the orphaned claim to be released")
        await eventually(lambda: not alive(leftover), what="the leftover workload process to be killed")
        await live_claim_kept_then_released(client, live, live_claim, tmp_path / "live")
    finally:
        await client.close()


async def test_killed_workload_returns_137_and_releases(cluster, tmp_path):
    client = await Client.connect(cluster.url)
    try:
        proc = await start_run(cluster, "--gpumem", "500", workload=["--alloc", "100", "--hold-file", str(tmp_path / "x")])
        os.kill((await read_report(proc))["pid"], signal.SIGKILL)
        done = await finish(proc)
        assert done.code == 128 + signal.SIGKILL
        assert not [c for c in await live_entries(client) if c.startswith("run-")]
    finally:
        await client.close()


async def test_sigterm_is_forwarded_and_the_exit_code_says_so(cluster, tmp_path):
    proc = await start_run(cluster, "--gpumem", "500", workload=["--alloc", "100", "--hold-file", str(tmp_path / "x")])
    await read_report(proc)
    proc.send_signal(signal.SIGTERM)
    done = await finish(proc)
    assert done.code == 128 + signal.SIGTERM


async def test_restarted_enforcer_adopts_live_workloads_and_releases_orphans(fresh_cluster, tmp_path):
    cluster = await fresh_cluster()
    client = await Client.connect(cluster.url)
    try:
        live = await start_run(cluster, "--gpumem", "500", workload=["--alloc", "100", "--hold-file", str(tmp_path / "live")])
        live_claim = await new_run_claim(client, set())
        orphan = await start_run(cluster, "--gpumem", "500", workload=["--alloc", "100", "--hold-file", str(tmp_path / "never")])
        orphan_claim = await new_run_claim(client, {live_claim})
        orphan_pid = (await read_report(orphan))["pid"]

        enforcer = cluster.find("enforcer-gpu-0")
        enforcer.proc.kill()
        enforcer.proc.wait()
        orphan.kill()  # its owner dies while no enforcer is watching
        await orphan.wait()
        await eventually(lambda: not alive(orphan_pid), what="the orphan's workload to die with its owner")

        cluster.spawn("enforcer", instance="enforcer-gpu-0", env={"TESSERA_NODE": "gpu-0"})

        await released_as_orphan(client, orphan_claim, "the orphan to be released by the restarted enforcer")
        await live_claim_kept_then_released(client, live, live_claim, tmp_path / "live")
        assert await live_entries(client) == {}
    finally:
        await client.close()
