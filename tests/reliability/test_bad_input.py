"""Bad input at every entry point gets a clear error or the dead-letter subject; nothing crashes.

Entry points: the CLI, the request/reply API, a malformed or invalid event published straight onto a
stream subject, and a broken fleet profile. After all of it, every service is still running and a
good claim still goes through.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path


from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota, dlq_decoder

from tessera.cli.client import Client

from kit import eventually

TESSERA = str(Path(sys.executable).parent / "tessera")


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TESSERA_NATS_URL=url, COLUMNS="200")
    return subprocess.run([TESSERA, *args], env=env, capture_output=True, text=True, timeout=60)


async def dead_letters(client: Client, wanted: set[str]) -> dict[str, list] | None:
    """The DLQ stream's letters by claim id, once a letter mentions each of ``wanted``."""
    bus = client.bus
    found: dict[str, list] = {}
    info = await bus.stream_info(subjects.STREAM_DLQ)
    if info.state.messages:
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await bus.stored_message(subjects.STREAM_DLQ, seq)
            letter = dlq_decoder.decode(msg.data)
            for claim in wanted:
                if f".{claim}." in letter.subject:
                    found.setdefault(claim, []).append((msg.subject, letter))
    return found if set(found) == wanted else None


async def test_bad_input_everywhere_is_refused_clearly_and_nothing_crashes(start_cluster, tmp_path):
    cluster = await start_cluster("tiny.yaml")
    url = cluster.url
    client = await Client.connect(url)
    try:
        await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name="alpha", quota=GpuQuota()), timeout=30)

        # CLI: out-of-range value, unknown tenant, unreachable NATS.
        run = await asyncio.to_thread(cli, url, "submit", "--tenant", "alpha", "--gpucores", "150")
        assert run.returncode == 1
        assert "gpucores" in run.stderr and "100" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
        run = await asyncio.to_thread(cli, url, "submit", "--tenant", "nobody", "--gpumem", "1000")
        assert run.returncode == 1 and "does not exist" in run.stderr and "tessera tenant create" in run.stderr
        run = await asyncio.to_thread(cli, "nats://127.0.0.1:1", "status")
        assert run.returncode == 4 and "make up" in run.stderr and "Traceback" not in run.stderr  # unavailable (README, Exit codes)

        # Request/reply: not JSON, an unknown field (a typo), a bad value with its path.
        reply = api.decode_reply(await client.bus.request(subjects.API_SUBMIT, b"{not json"))
        assert not reply.ok and "JSON" in reply.error.message
        reply = api.decode_reply(await client.bus.request(
            subjects.API_SUBMIT, b'{"tenant": "alpha", "resourcez": {}}'))
        assert not reply.ok and "resourcez" in reply.error.message
        reply = api.decode_reply(await client.bus.request(
            subjects.API_SUBMIT, b'{"tenant": "alpha", "resources": {"nvidia.com/gpumem": "8Gi"}}'))
        assert not reply.ok and "gpumem" in reply.error.field and "8192" in reply.error.message
        reply = api.decode_reply(await client.bus.request(
            subjects.API_SUBMIT, b'{"tenant": "alpha", "spec": {"gpus": 0}}'))
        assert not reply.ok and reply.error.field == "$.spec.gpus"
        # chown's "no change" (-1) is never a workload's uid: it would keep whatever owner a file had
        reply = api.decode_reply(await client.bus.request(
            subjects.API_SUBMIT, b'{"tenant": "alpha", "resources": {"nvidia.com/gpumem": 1000}, "workload_uid": -1}'))
        assert not reply.ok and reply.error.field == "$.workload_uid", reply.error

        # Events straight onto the stream: garbage, and valid JSON that breaks the schema.
        bus = client.bus
        await bus.publish_bytes(subjects.claim("alpha", "bad-1", "requested"), b"{not json")
        await bus.publish_bytes(subjects.claim("alpha", "bad-2", "requested"),
                         b'{"kind": "requested", "claim": "bad-2", "tenant": "alpha", "spec": {"gpus": 0}}')
        await bus.publish_bytes(subjects.claim("alpha", "bad-3", "allocated", "gpu-0"), b'{"kind": "allocated"}')
        by_claim = await eventually(lambda: dead_letters(client, {"bad-1", "bad-2", "bad-3"}), timeout=30, every=0.2,
                                    what="a dead letter for each of bad-1, bad-2 and bad-3")
        assert "invalid payload" in by_claim["bad-1"][0][1].reason
        assert "$.spec.gpus" in by_claim["bad-2"][0][1].reason
        assert {s for s, _ in by_claim["bad-3"]} == {subjects.dlq("enforcer")}
        assert all(letter.payload for letters in by_claim.values() for _, letter in letters)

        # Everything still runs, and a good claim still goes through.
        assert cluster.dead() == []
        good = await client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": 1000}))
        record = await client.wait_for(good["claim"], {"prepared"}, timeout=30)
        assert record.devices[0].memory_mib == 1000
    finally:
        await client.close()


def test_a_broken_profile_stops_the_capacity_publisher_with_the_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups:\n  - prefix: x\n    nodes: 1\n    gpus: 1\n    model: T4\n    memory_mib: -5\n")
    env = dict(os.environ, TESSERA_PROFILE=str(bad), TESSERA_NATS_URL="nats://127.0.0.1:1")
    run = subprocess.run([str(Path(sys.executable).parent / "tessera-capacity")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "$.groups[0].memory_mib" in run.stderr and "Traceback" not in run.stderr
