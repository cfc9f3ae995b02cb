"""A tenant, or a compromised GPU node's enforcer, cannot read another tenant's secrets; a reader of
the raw bucket gets ciphertext.

Against `tessera up`'s system (its nats-server with the generated authorization, the real manager
issuing real credentials): tenant alpha, with the credentials the manager gave it, looks for beta's
CA key and datastore password in ``controlplane-secrets`` and finds no such bucket in its account;
an enforcer, with its node's identity, asks the platform account's JetStream for the bucket and the
value and is refused by the server. What is left is whoever reads the stream itself (the operator
identity, the server's disk, a backup): before sealing that read returned beta's CA key in the
clear, now it returns an envelope that neither decodes nor contains a key, a password or a PEM.
"""

from __future__ import annotations

import msgspec
import nats
import pytest
from nats.js.errors import BucketNotFoundError

from tessera.cli.client import Client
from tessera.controlplane.credentials import TenantSecrets
from tessera.controlplane.store import KV_SECRETS
from tessera.shared import api, identities, subjects
from tessera.shared.events import GpuQuota

from secretscan import needles, tenant_secrets

STREAM = f"KV_{KV_SECRETS}"


@pytest.fixture
async def system(start_cluster):
    cluster = await start_cluster("tiny.yaml")
    operator = await Client.connect(cluster.url)
    try:
        for name in ("alpha", "beta"):
            reply = await operator.call(f"{subjects.API_TENANTS}.create",
                                        api.TenantRequest(name=name, quota=GpuQuota(gpus=2)), timeout=30)
            assert reply["phase"] == "Ready", reply
        yield cluster, operator
    finally:
        await operator.close()


async def connect(url: str, user: str, password: str, inbox: str):
    refusals: list[str] = []

    async def on_error(exc: Exception) -> None:
        refusals.append(str(exc).lower())

    nc = await nats.connect(servers=[url], user=user, password=password, inbox_prefix=inbox,
                            error_cb=on_error, allow_reconnect=False, connect_timeout=5)
    return nc, refusals


async def test_a_tenant_and_an_enforcer_are_refused_and_the_raw_bucket_is_ciphertext(system):
    cluster, operator = system
    beta = await tenant_secrets(cluster, operator.bus, "beta")
    alpha = await tenant_secrets(cluster, operator.bus, "alpha")
    assert "-----BEGIN" in beta.pki["ca.key"] and beta.datastore.password  # there is something to steal

    # Tenant alpha, as itself: its account has no such bucket, and nothing answers a direct get.
    nc, _ = await connect(cluster.nats.url, alpha.datastore.username, alpha.datastore.password,
                          alpha.datastore.inbox_prefix or "_INBOX")
    try:
        with pytest.raises(BucketNotFoundError):
            await nc.jetstream().key_value(KV_SECRETS)
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request(f"$JS.API.DIRECT.GET.{STREAM}.$KV.{KV_SECRETS}.beta", b"", timeout=3)
    finally:
        await nc.close()

    # A GPU node's enforcer, as itself: the platform account's JetStream refuses it the bucket.
    node = cluster.nodes()[0]
    user = identities.user_for("enforcer", node)
    nc, refusals = await connect(cluster.nats.url, user, cluster.passwords[user], identities.inbox_prefix(user))
    try:
        for subject in (f"$JS.API.STREAM.INFO.{STREAM}", f"$JS.API.DIRECT.GET.{STREAM}.$KV.{KV_SECRETS}.beta",
                        f"$JS.API.STREAM.MSG.GET.{STREAM}"):
            with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
                await nc.request(subject, b"", timeout=3)
            await nc.flush()
        assert sum("permissions violation" in r for r in refusals) == 3, refusals
        with pytest.raises(nats.errors.TimeoutError):
            await nc.jetstream().key_value(KV_SECRETS)
    finally:
        await nc.close()
    assert identities.KV_SECRETS not in identities.uses("enforcer", node).buckets()

    # Whoever reads the stream itself: ciphertext, no key, no password, nothing that decodes.
    raw = (await (await operator.bus.kv(KV_SECRETS)).get("beta")).value
    assert b"BEGIN" not in raw and b"PRIVATE KEY" not in raw, raw[:200]
    for label, needle in needles(beta).items():
        assert needle not in raw, f"{label} readable in the raw bucket"
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(raw, type=TenantSecrets)
