"""The manager's request/reply API, end to end through a real nats-server and the real service."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from tessera.shared import subjects
from tessera.shared.events import TenantRecord, tenant_decoder
from tessera.shared.secretkeys import write_key_file

from kit import eventually


async def _wait_ready(bus, call, timeout=20.0):
    """The manager process answers (a request fails until it serves)."""
    return await eventually(lambda: call(bus, "list", {}), timeout=timeout, every=0.2, what="the manager answering")


@pytest.fixture
def manager_process(nats_url, tmp_path):
    write_key_file(tmp_path / "secret-keys")
    env = dict(os.environ, TESSERA_NATS_URL=nats_url, TESSERA_STREAM_STORAGE="memory",
               TESSERA_CP_SECRET_KEY_FILE=str(tmp_path / "secret-keys"))
    with open(tmp_path / "manager.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tessera.controlplane"], env=env,
            stdout=subprocess.DEVNULL, stderr=log,
        )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.returncode == 0, (tmp_path / "manager.log").read_text()


async def test_service_creates_lists_and_deletes_tenants_with_events(bus, manager_process, call_api):
    call = call_api
    await _wait_ready(bus, call)
    events = []

    async def collect(msg):
        events.append(tenant_decoder.decode(msg.data))

    sub = await bus.listen(f"{subjects.TENANTS}.>", collect)

    reply = await call(bus, "create", {"name": "team-a", "quota": {"gpus": 4, "memory_mib": 40000}})
    assert reply.ok, reply.error
    assert reply.result["phase"] == "Ready"
    again = await call(bus, "create", {"name": "team-a", "quota": {"gpus": 4, "memory_mib": 40000}})
    assert again.ok and again.result["generation"] == 1  # a second identical create changes nothing

    kv = await bus.kv(subjects.KV_TENANTS)
    record = msgspec.json.decode((await kv.get("team-a")).value, type=TenantRecord)
    assert record.quota.gpus == 4 and record.phase == "Ready"

    listed = await call(bus, "list", {})
    assert [t["name"] for t in listed.result] == ["team-a"]
    got = await call(bus, "get", {"name": "team-a"})
    assert got.result["quota"]["memory_mib"] == 40000

    gone = await call(bus, "delete", {"name": "team-a"})
    assert gone.ok and gone.result["existed"]
    missing = await call(bus, "get", {"name": "team-a"})
    assert not missing.ok and missing.error.code == "not-found"
    assert (await call(bus, "list", {})).result == []

    await eventually(lambda: {"created", "deleted"} <= {e.__struct_config__.tag for e in events}, every=0.05,
                     what="the created and deleted events")
    await sub.unsubscribe()
    kinds = [e.__struct_config__.tag for e in events]
    assert kinds.count("created") == 1 and kinds[-1] == "deleted"


async def test_bad_requests_name_the_field(bus, manager_process, call_api):
    call = call_api
    await _wait_ready(bus, call)
    cases = [
        ({"name": "Team_A"}, "name"),
        ({"name": "a", "quota": {"gpus": -1}}, "quota.gpus"),
        ({"name": "a", "quotta": {}}, "quotta"),
        ({"name": "a", "spec": {"network": {"port": 70000}}}, "spec.network.port"),
        ({"name": "a", "spec": {"size": "huge"}}, "spec.size"),
        ({"name": "a", "spec": {"network": {"podCidr": "10.96.0.0/12"}}}, "spec.network.podCidr"),
    ]
    for payload, field in cases:
        reply = await call(bus, "create", payload)
        assert not reply.ok, payload
        assert field in (reply.error.field + " " + reply.error.message), (payload, reply.error)
    junk = await call(bus, "create", b"{not json")
    assert not junk.ok and "JSON" in junk.error.message
    assert (await call(bus, "list", {})).result == []
