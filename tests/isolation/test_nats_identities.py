"""Each service's NATS identity does its job and nothing else; a tenant's account is a fence.

Against a real nats-server running the config `tessera.shared.identities` generates: a probe per
service (what it must be able to do works; a publish, subscribe or KV access outside its list is a
permissions violation), a tenant that looks for the manager's secrets and another tenant's API,
and a tenant that floods its JetStream until the account limit stops it while the platform's
ledger writes go on.
"""

from __future__ import annotations


import nats
import pytest
from nats.js.errors import BucketNotFoundError

from tessera.shared import identities, subjects
from tessera.shared.bus import Bus
from tessera.shared.settings import BusSettings

from tessera.controlplane.datastores.natskv import connect_ok

from natsauth import FLOOD_LIMITS, Probe, password, secured_server

SECRETS = identities.KV_SECRETS


@pytest.fixture
async def secured(tmp_path):
    server = secured_server(tmp_path / "nats").start()
    bare = server.url
    # The operator lays out the platform's topology and puts a secret where a thief would look.
    bus = await Bus.connect(BusSettings(url=bare, user=identities.OPERATOR, password=password(identities.OPERATOR)),
                            "cli")
    await bus.ensure_topology()
    await (await bus.kv(SECRETS)).put("beta", b'{"ca.key": "-----BEGIN PRIVATE KEY-----"}')
    await bus.kv(identities.KV_CONTROLPLANES)
    await bus.close()
    yield bare
    server.stop()


ALLOWED = {
    # (a deleted tenant's claims: their releases, to placement or to the claim's node)
    "controlplane": [("kv", SECRETS, "alpha"), ("js", "tessera.tenants.alpha.created"),
                     ("js", subjects.claim("alpha", "c1", "release")),
                     ("js", subjects.claim("alpha", "c1", "release", "gpu-0"))],
    "capacity": [("kv", subjects.KV_INVENTORY, "gpu-0"), ("js", subjects.inventory("gpu-0"))],
    "translator": [("kv", subjects.KV_CLAIMS, "c1"), ("js", subjects.claim("alpha", "c1", "requested"))],
    "placement": [("kv", subjects.KV_LEDGER, subjects.ledger_node_key("gpu-0")),
                  ("js", subjects.claim("alpha", "c1", "allocated", "gpu-0"))],
    "enforcer-gpu-0": [("kv", subjects.KV_LEDGER, subjects.ledger_node_key("gpu-0")),
                       ("js", subjects.claim("alpha", "c1", "prepared", "gpu-0")), ("js", subjects.usage("gpu-0"))],
}

LEDGER_WRITE = f"$KV.{subjects.KV_LEDGER}.{subjects.ledger_node_key('gpu-0')}"
SECRETS_READ = f"$JS.API.STREAM.INFO.KV_{SECRETS}"
SECRET_GET = f"$JS.API.DIRECT.GET.KV_{SECRETS}.$KV.{SECRETS}.beta"
TENANTS_READ = f"$JS.API.STREAM.INFO.KV_{subjects.KV_TENANTS}"
REFUSED = {
    "controlplane": [("publish", LEDGER_WRITE), ("publish", subjects.claim("alpha", "c1", "requested")),
                     ("publish", subjects.claim("alpha", "c1", "released", "gpu-0")),
                     ("publish", f"$KV.{subjects.KV_CLAIMS}.c1")],
    "capacity": [("publish", LEDGER_WRITE), ("publish", subjects.claim("alpha", "c1", "allocated", "gpu-0")),
                 ("request", TENANTS_READ), ("request", SECRETS_READ)],
    "translator": [("publish", LEDGER_WRITE), ("publish", f"$KV.{subjects.KV_TENANTS}.alpha"),
                   ("publish", "tessera.tenants.alpha.created"), ("request", SECRETS_READ)],
    "placement": [("publish", f"$KV.{subjects.KV_TENANTS}.alpha"), ("publish", f"$KV.{subjects.KV_INVENTORY}.gpu-0"),
                  ("request", SECRETS_READ), ("request", SECRET_GET), ("subscribe", f"{subjects.API_TENANTS}.*")],
    # A compromised GPU node: no tenant's secrets, no other node's events, inventory or usage, no
    # serving the claim API (to phish requests), no reading other identities' replies.
    "enforcer-gpu-0": [("request", SECRETS_READ), ("request", SECRET_GET), ("request", TENANTS_READ),
                       ("publish", f"$KV.{SECRETS}.beta"), ("publish", f"$KV.{subjects.KV_TENANTS}.alpha"),
                       ("publish", subjects.claim("alpha", "c1", "prepared", "gpu-1")),
                       ("publish", subjects.usage("gpu-1")), ("publish", f"$KV.{subjects.KV_INVENTORY}.gpu-1"),
                       ("subscribe", subjects.API_SUBMIT), ("subscribe", f"{identities.inbox_prefix('operator')}.>")],
}


@pytest.mark.parametrize("user", sorted(ALLOWED))
async def test_each_service_identity_does_its_job_and_is_refused_outside_it(secured, user):
    probe = await Probe.connect(secured, user)
    try:
        js = probe.nc.jetstream()
        for kind, where, what in [(a[0], a[1], a[2] if len(a) > 2 else None) for a in ALLOWED[user]]:
            if kind == "kv":
                assert await (await js.key_value(where)).put(what, b"{}") > 0
            else:
                assert (await js.publish(where, b"{}")).seq > 0
        assert probe.violations == []
        for action, subject in REFUSED[user]:
            await probe.refused(subject, action=action)
    finally:
        await probe.close()


async def test_every_service_has_a_permission_entry_derived_from_the_subjects():
    # The table is the one place: every stream a service touches is among subjects.STREAMS, every
    # bucket is a platform or manager bucket, and each service may publish to its dead-letter subject.
    for service in identities.SERVICES:
        uses = identities.uses(service)
        assert set(uses.streams()) <= set(subjects.STREAMS)
        assert set(uses.buckets()) <= {*subjects.KV_BUCKETS, identities.KV_SECRETS, identities.KV_CONTROLPLANES}
        assert subjects.dlq(service) in identities.permissions(service)["publish"]["allow"]
    with pytest.raises(ValueError, match="no identity for service 'cupsd'"):
        identities.uses("cupsd")


async def test_a_tenant_cannot_reach_the_managers_secrets_nor_another_tenants_api(secured):
    probe = await Probe.connect(secured, "tenant-alpha")
    try:
        js = probe.nc.jetstream()
        # Its account has its own JetStream, and no such bucket in it: the platform's are not there.
        for bucket in (SECRETS, subjects.KV_TENANTS, subjects.KV_CLAIMS, subjects.KV_LEDGER):
            with pytest.raises(BucketNotFoundError):
                await js.key_value(bucket)
        # Nothing answers another tenant's claim API, nor the manager's tenant API, for it.
        for subject in (identities.tenant_api_subject("beta", "get"), f"{subjects.API_TENANTS}.list",
                        f"$JS.API.DIRECT.GET.KV_{SECRETS}.$KV.{SECRETS}.beta"):
            with pytest.raises(nats.errors.NoRespondersError):
                await probe.nc.request(subject, b"{}", timeout=2)
    finally:
        await probe.close()


async def test_a_tenant_flood_stops_at_its_account_limit_and_platform_ledger_writes_still_succeed(secured):
    tenant = await Probe.connect(secured, "tenant-alpha")
    placement = await Probe.connect(secured, "placement")
    try:
        js = tenant.nc.jetstream()
        await js.add_stream(name="FLOOD", subjects=["flood.>"])
        chunk = b"x" * (32 * 1024)
        stored = 0
        refusal = None
        for _ in range(4 * FLOOD_LIMITS.max_file // len(chunk)):
            try:
                await js.publish("flood.data", chunk)
                stored += len(chunk)
            except nats.js.errors.APIError as exc:
                refusal = exc
                break
        assert refusal is not None, "the tenant stored four times its limit"
        assert "resource limits exceeded for account" in str(refusal), refusal
        assert FLOOD_LIMITS.max_file // 2 <= stored <= FLOOD_LIMITS.max_file
        # More streams than the account may have: refused too.
        await js.add_stream(name="SECOND", subjects=["second.>"])
        with pytest.raises(nats.js.errors.APIError, match="(?i)maximum number of streams"):
            await js.add_stream(name="THIRD", subjects=["third.>"])

        ledger = await placement.nc.jetstream().key_value(subjects.KV_LEDGER)
        for _ in range(20):
            assert await ledger.put(subjects.ledger_node_key("gpu-0"), b'{"node": "gpu-0", "entries": {}}') > 0
    finally:
        await tenant.close()
        await placement.close()


async def test_a_tenant_account_refuses_connections_beyond_its_limit(secured):
    probes = [await Probe.connect(secured, "tenant-beta") for _ in range(FLOOD_LIMITS.max_connections)]
    try:
        assert not await connect_ok(secured, "tenant-beta", password("tenant-beta"), "_INBOX")
        # The limit is the account's: another tenant, and the platform, still connect.
        assert await connect_ok(secured, "tenant-alpha", password("tenant-alpha"), "_INBOX")
        assert await connect_ok(secured, "placement", password("placement"), identities.inbox_prefix("placement"))
    finally:
        for probe in probes:
            await probe.close()


@pytest.mark.parametrize("user", ["placement", "enforcer-gpu-0"])
async def test_a_consuming_service_may_watch_its_max_deliveries_advisory(secured, user):
    """The bus dead-letters what the server stops delivering (max_deliver spent) from the server's
    advisory; a service whose identity may not subscribe to it never learns of those messages."""
    from tessera.shared.bus import MAX_DELIVERIES_ADVISORY

    probe = await Probe.connect(secured, user)
    try:
        await probe.nc.subscribe(MAX_DELIVERIES_ADVISORY.format(stream=subjects.STREAM_CLAIMS, consumer=user))
        # The server answers a SUB it refuses with -ERR before the flush's PONG, and the client's read
        # loop awaits the error callback on that -ERR before it reads on: after the flush, a refusal
        # is in the violations.
        await probe.nc.flush()
        assert probe.violations == []
    finally:
        await probe.close()
