"""Every read command's `-o json` is one parseable document with the fields docs/cli.md names, and
the exit codes are the documented ones; the read commands work under the read-only viewer."""

from __future__ import annotations

import json

from tessera.shared import api, identities, subjects
from tessera.shared.events import GpuQuota

from tessera.cli import exitcodes
from tessera.cli.client import Client

from clikit import tessera
from kit import eventually

NODE_FIELDS = {"node", "lost", "cpu_millis", "cpu_free_millis", "host_memory_mib", "host_memory_free_mib",
               "fragmentation", "free_gpu_units", "fragmentation_ratio", "gpus"}
GPU_FIELDS = {"uuid", "index", "model", "memory_mib", "healthy", "max_shares", "shares", "exclusive",
              "allocated_mib", "cores_allocated", "used_mib", "free_gpu_units", "slices"}
SLICE_FIELDS = {"claim", "tenant", "memory_mib", "cores", "used_mib"}
TENANT_FIELDS = {"tenant", "known", "phase", "quota", "used", "claims"}
CLAIM_FIELDS = {"claim", "tenant", "state", "spec", "node", "devices", "reason", "updated"}
LETTER_FIELDS = {"seq", "service", "subject", "reason", "deliveries", "stream", "ts", "payload", "replayed",
                 "replayed_at", "replayed_seq"}


async def test_read_commands_print_documented_json(cluster):
    operator = ["--nats", cluster.url]
    viewer = ["--nats", cluster.url_for(identities.VIEWER)]
    client = await Client.connect(cluster.url)
    try:
        await client.call(f"{subjects.API_TENANTS}.create",
                          api.TenantRequest(name="jsonteam", quota=GpuQuota(gpus=2, memory_mib=50000)), timeout=30)
    finally:
        await client.close()

    ran = await tessera("submit", *operator, "--tenant", "jsonteam", "--gpumem", "12000", "--gpucores", "30",
                        "--wait", "-o", "json")
    assert ran.code == exitcodes.OK, ran.err
    record = json.loads(ran.out)
    assert CLAIM_FIELDS <= set(record) and record["state"] == "prepared"
    claim = record["claim"]

    ran = await tessera("status", *viewer, "-o", "json")
    assert ran.code == exitcodes.OK, ran.err
    doc = json.loads(ran.out)
    assert {"time", "totals", "mix", "claims", "tenants", "nodes", "skipped"} <= set(doc)
    assert {"nodes", "lost_nodes", "gpus", "memory_mib", "allocated_mib", "used_mib", "fragmentation",
            "free_gpu_units"} <= set(doc["totals"])
    assert doc["totals"]["nodes"] == 2 and doc["totals"]["gpus"] == 4
    assert all(NODE_FIELDS <= set(n) for n in doc["nodes"])
    gpus = [g for n in doc["nodes"] for g in n["gpus"]]
    assert all(GPU_FIELDS <= set(g) for g in gpus)
    slices = [s for g in gpus for s in g["slices"]]
    mine = [s for s in slices if s["claim"] == claim]
    assert len(mine) == 1 and SLICE_FIELDS <= set(mine[0])
    assert (mine[0]["tenant"], mine[0]["memory_mib"], mine[0]["cores"]) == ("jsonteam", 12000, 30)
    holder = next(n for n in doc["nodes"] if any(s["claim"] == claim for g in n["gpus"] for s in g["slices"]))
    assert holder["fragmentation"] > 0  # a partly used card strands capacity for whole-GPU kinds
    team = next(t for t in doc["tenants"] if t["tenant"] == "jsonteam")
    assert TENANT_FIELDS <= set(team)
    assert team["quota"] == {"gpus": 2, "memory_mib": 50000, "cores": None}
    assert team["used"] == {"gpus": 1, "memory_mib": 12000, "cores": 30}
    assert doc["claims"]["by_state"]["prepared"] >= 1

    ran = await tessera("claims", *viewer, "-o", "json")
    assert ran.code == exitcodes.OK, ran.err
    claims = json.loads(ran.out)
    assert isinstance(claims, list) and all(CLAIM_FIELDS <= set(c) for c in claims)
    assert claim in {c["claim"] for c in claims}
    ran = await tessera("claims", *viewer, claim, "-o", "json")
    assert [c["claim"] for c in json.loads(ran.out)] == [claim]
    ran = await tessera("claims", *viewer, "no-such-claim", "-o", "json")
    assert ran.code == exitcodes.FAILED and "no such claim" in ran.err and ran.out == ""

    ran = await tessera("dlq", "list", *viewer, "-o", "json")
    assert ran.code == exitcodes.OK, ran.err
    letters = json.loads(ran.out)
    assert isinstance(letters, list) and all(LETTER_FIELDS <= set(x) for x in letters)

    ran = await tessera("tenant", "list", "--nats", cluster.url, "-o", "json")
    assert ran.code == exitcodes.OK, ran.err
    reply = json.loads(ran.out)
    assert reply["ok"] and "jsonteam" in {t["name"] for t in reply["result"]}
    ran = await tessera("tenant", "get", "jsonteam", "--nats", cluster.url, "-o", "json")
    assert json.loads(ran.out)["result"]["name"] == "jsonteam"

    ran = await tessera("release", *operator, claim, "--wait", "-o", "json")
    assert ran.code == exitcodes.OK and json.loads(ran.out) == {"claim": claim, "state": "released"}


async def test_exit_codes_are_the_documented_ones(cluster):
    operator = ["--nats", cluster.url]
    ran = await tessera("status", "--nats", "nats://127.0.0.1:1")
    assert ran.code == exitcodes.UNAVAILABLE and "make up" in ran.err and "Traceback" not in ran.err
    ran = await tessera("tenant", "list", "--nats", "nats://127.0.0.1:1")
    assert ran.code == exitcodes.UNAVAILABLE, ran.err
    ran = await tessera("submit", *operator, "--tenant", "nobody-here", "--gpumem", "1000")
    assert ran.code == exitcodes.FAILED and "does not exist" in ran.err
    ran = await tessera("status", "-o", "yaml", *operator)
    assert ran.code == exitcodes.USAGE and "json" in ran.err
    ran = await tessera("dlq", "replay", *operator, "999999")
    assert ran.code == exitcodes.FAILED and "no dead letter at sequence 999999" in ran.err
    client = await Client.connect(cluster.url)
    try:
        await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name="codes", quota=GpuQuota()), timeout=30)
        # more GPUs on one node than it has: placement answers at once
        ran = await tessera("submit", *operator, "--tenant", "codes", "--gpus", "3", "--node", "gpu-0", "--wait")
        assert ran.code == exitcodes.UNSCHEDULABLE and "unschedulable" in ran.err, ran.err
        # a wait (a watch of the claim's key) for a state the claim does not reach runs out
        ran = await tessera("submit", *operator, "--tenant", "codes", "--gpumem", "1000", "--wait", "-o", "json")
        claim = json.loads(ran.out)["claim"]
        try:
            await client.wait_for(claim, {"running"}, timeout=1)
        except Exception as exc:
            assert getattr(exc, "code", None) == exitcodes.TIMEOUT and "still prepared" in str(exc), exc
        else:
            raise AssertionError("the wait for 'running' returned for a claim that never ran")
        # and one that the claim does reach returns as soon as the change is watched
        await client.release(claim)
        assert (await client.wait_for(claim, {"released"}, timeout=30)).state == "released"
    finally:
        await client.close()


async def test_top_draws_the_fleet_and_quits_on_ctrl_c(cluster):
    import asyncio
    import os
    import signal

    from clikit import TESSERA

    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_NATS")}
    env["COLUMNS"] = "200"
    # Consumers on the usage stream before top starts: an earlier test's fleet view may leave its
    # ephemeral one there for a few seconds; top's own is the one not among these.
    earlier = await usage_consumers(cluster.url)
    proc = await asyncio.create_subprocess_exec(TESSERA, "top", "--nats", cluster.url_for(identities.VIEWER),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env=env)
    client = await Client.connect(cluster.url)
    try:
        await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name="topteam", quota=GpuQuota()),
                          timeout=30)
        claim = (await client.submit(api.SubmitRequest(tenant="topteam", resources={"nvidia.com/gpumem": 3000})))["claim"]
        await client.wait_for(claim, {"prepared"}, timeout=60)
        # top is drawing once it follows the usage stream (its consumer there is its last step before
        # the live table; only the fleet views consume that stream)
        async def drawing() -> bool:
            return bool((await usage_consumers(cluster.url, client)) - earlier) or proc.returncode is not None

        await eventually(drawing, timeout=60, what="top following the usage stream (or exited)")
    finally:
        await client.close()
    proc.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == exitcodes.OK, err.decode()
    text = out.decode()
    assert "Tessera fleet" in text and "gpu-0" in text and "gpu-1" in text and "topteam" in text, text


async def test_ui_serves_the_fleet_document_until_ctrl_c(cluster):
    import asyncio
    import os
    import re
    import signal
    import urllib.request

    from clikit import TESSERA

    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_NATS")}
    proc = await asyncio.create_subprocess_exec(TESSERA, "ui", "--port", "0", "--nats", cluster.url_for(identities.VIEWER),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        url = re.search(r"fleet view at (http://127\.0\.0\.1:\d+/)", line).group(1)

        def get(path: str) -> bytes:
            with urllib.request.urlopen(url + path, timeout=10) as response:
                return response.read()

        doc = json.loads(await asyncio.to_thread(get, "api/fleet"))
        assert doc["totals"]["nodes"] == 2
        assert b"EventSource" in await asyncio.to_thread(get, "")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == exitcodes.OK, err.decode()


async def usage_consumers(url: str, client: Client | None = None) -> set[str]:
    """Names of the consumers the usage stream has now."""
    own = client is None
    client = client or await Client.connect(url)
    try:
        return {c.name for c in await client.bus.consumers_info(subjects.STREAM_USAGE)}
    finally:
        if own:
            await client.close()
