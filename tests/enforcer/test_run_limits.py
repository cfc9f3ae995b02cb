"""`tessera run` on the simulated driver: the workload gets its limits, its devices and nothing more,
its exit code comes back, usage events say what it allocated, and the claim is released after.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tessera.cli.client import Client

from kit import eventually
from runkit import MIB, OTHER_USERS_PYTHON, UsageListener, finish, live_entries, run_claims, start_run, tessera_run, same_python_for_other_users

OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


async def only_run_claim(client: Client, states=("prepared", "running")) -> str:
    async def find():
        claims = [c for c, s in (await run_claims(client)).items() if s in states]
        return claims[0] if len(claims) == 1 else None

    return await eventually(find, what="the tessera run claim")


async def test_within_limit_usage_matches_allocation_and_claim_is_released(cluster, tmp_path):
    client = await Client.connect(cluster.url)
    hold = tmp_path / "go"
    proc = None
    try:
        async with UsageListener(client) as usage:
            proc = await start_run(cluster, "--gpumem", "1000", "--gpucores", "30",
                                   workload=["--alloc", "300,200", "--hold-file", str(hold)])
            claim = await only_run_claim(client, states=("running",))

            def holding():
                return [e for e in usage.of(claim) if e.devices and e.devices[0].used_bytes == 500 * MIB]

            event = (await eventually(holding, what="a usage event with 500 MiB used"))[-1]
            assert event.tenant == "alpha" and event.node == "gpu-0"
            assert event.processes == 1
            assert event.devices[0].limit_bytes == 1000 * MIB
            assert event.devices[0].sm_limit == 30
            assert claim in await live_entries(client)
            hold.touch()
            done = await finish(proc)
        assert done.code == 0, done.stderr
        report = done.report()
        assert report["alloc"] == [[300, 0], [200, 0]]
        assert report["total_mib"] == 1000 and report["free_mib"] == 500
        assert report["count"] == 1
        record = await client.claim(claim)
        assert record.state == "released"
        assert claim not in await live_entries(client)
    finally:
        hold.touch()  # a failed assertion must not leave the workload (and its claim) to the next test
        if proc is not None and proc.returncode is None:
            await finish(proc)
        await client.close()


async def test_over_limit_gets_out_of_memory_and_claim_is_still_released(cluster):
    client = await Client.connect(cluster.url)
    try:
        done = await tessera_run(cluster, "--gpumem", "1000", workload=["--alloc", "600,600,300", "--exit", "7"])
        assert done.code == 7, done.stderr  # the workload's own exit code
        assert done.report()["alloc"] == [[600, 0], [600, OOM], [300, 0]]
        assert await run_claims(client) and set((await run_claims(client)).values()) == {"released"}
        assert not [c for c in await live_entries(client) if c.startswith("run-")]
    finally:
        await client.close()


async def test_workload_cannot_raise_its_own_limit(cluster):
    done = await tessera_run(cluster, "--gpumem", "1000", workload=["--raise-limit", "100g", "--alloc", "1500,900"])
    assert done.code == 0, done.stderr
    report = done.report()
    assert report["alloc"] == [[1500, OOM], [900, 0]]
    assert report["total_mib"] == 1000


async def test_workload_sees_only_its_allocated_gpus(cluster):
    client = await Client.connect(cluster.url)
    try:
        done = await tessera_run(cluster, "--gpus", "2", "--gpumem", "500", workload=["--alloc", "100"])
        assert done.code == 0, done.stderr
        report = done.report()
        records = [r for c, r in (await client.fleet()).claims.items() if c.startswith("run-")]
        record = max(records, key=lambda r: r.updated)
        assert report["count"] == 2
        assert report["uuids"] == [d.uuid for d in sorted(record.devices, key=lambda d: d.index)]
    finally:
        await client.close()


async def test_unschedulable_claim_exits_3_with_the_reason(cluster):
    client = await Client.connect(cluster.url)
    try:
        done = await tessera_run(cluster, "--gpus", "3", "--gpumem", "1000", workload=[])
        assert done.code == 3, (done.stdout, done.stderr)
        assert "cannot be placed on node gpu-0" in done.stderr
        assert not [c for c in await live_entries(client) if c.startswith("run-")]
    finally:
        await client.close()


async def test_bad_input_gets_a_clear_error(cluster):
    no_command = await tessera_run(cluster, "--gpumem", "1000", command=[])
    assert no_command.code == 2 and "after --" in no_command.stderr
    bad_percent = await tessera_run(cluster, "--gpumem-percent", "150", workload=[])
    assert bad_percent.code == 1 and "gpumem-percentage" in bad_percent.stderr
    missing = await tessera_run(cluster, "--gpumem", "100", command=["/nonexistent/program"])
    assert missing.code == 127 and "command not found" in missing.stderr


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="running `tessera run` as another user needs root")
@pytest.mark.skipif(not same_python_for_other_users(), reason=f"{OTHER_USERS_PYTHON} is not this interpreter's version")
async def test_tessera_run_by_a_non_root_user_against_a_root_enforcer_gets_its_memory(fresh_cluster, tmp_path):
    # The harness keeps its temporary directories root's alone; a node's state directory is
    # traversable by its users (the claim directories below it decide who gets what).
    for parent in [tmp_path, *tmp_path.parents]:
        if parent != Path("/") and not parent.stat().st_mode & 0o001:
            parent.chmod(parent.stat().st_mode | 0o011)
    cluster = await fresh_cluster()
    done = await tessera_run(cluster, "--gpumem", "256", workload=["--alloc", "256,1"], user=NOBODY)
    assert done.code == 0, done.stderr
    assert done.report()["alloc"] == [[256, 0], [1, OOM]]  # exactly the claim's memory, then refused
    # The uid went with the claim, which is how its accounting file became that uid's (0600): without
    # it the file is in a directory only root can traverse, and this workload got nothing.
    client = await Client.connect(cluster.url)
    try:
        (claim,) = await run_claims(client)
        assert (await client.claim(claim)).spec.workload_uid == NOBODY
    finally:
        await client.close()
