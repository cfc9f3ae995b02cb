"""Streams and buckets as `tessera.shared.topology` declares them, against a real nats-server.

The services make the server match the table (created, or updated when an older deployment left
other limits behind, KV buckets included); readers only bind, and an empty server stays empty when
a reader looks at it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import nats
import pytest
from nats.js import api

from tessera.shared import identities, subjects, topology
from tessera.shared.bus import Bus
from tessera.shared.errors import ConfigError
from tessera.shared.natsserver import NatsCluster
from tessera.shared.settings import BusSettings

TABLE = topology.declare(topology.TopologySettings())


async def _js(url: str):
    nc = await nats.connect(url)
    return nc, nc.jetstream(timeout=5)


async def test_a_tool_creates_every_declared_stream_and_bucket_with_its_limits(nats_url):
    bus = await Bus.connect(BusSettings(url=nats_url, stream_max_bytes=64 * 2**20, usage_retention=600), "cli")
    try:
        done = await bus.ensure_topology()
        assert set(done.values()) == {"created"} and set(done) == set(TABLE.streams) | set(TABLE.buckets)
        claims = (await bus.stream_info(subjects.STREAM_CLAIMS)).config
        assert (claims.max_bytes, claims.max_age, claims.discard) == (64 * 2**20, 7 * 24 * 3600, api.DiscardPolicy.OLD)
        usage = (await bus.stream_info(subjects.STREAM_USAGE)).config
        assert (usage.max_age, usage.max_msgs_per_subject) == (600, topology.PER_NODE_MESSAGES)
        for bucket in TABLE.buckets:
            config = (await bus.stream_info(f"KV_{bucket}")).config
            assert config.max_bytes > 0 and config.max_msgs_per_subject == 5
            assert config.discard == api.DiscardPolicy.NEW  # a full bucket refuses, never drops state
        assert set((await bus.ensure_topology()).values()) == {"unchanged"}
    finally:
        await bus.close()


async def test_an_existing_bucket_and_stream_are_brought_to_the_declared_limits(nats_url):
    """What an older deployment left: a claims bucket and stream with no size limit (and one
    revision of history): the next service start updates both in place, values kept."""
    nc, js = await _js(nats_url)
    try:
        old = await js.create_key_value(bucket=subjects.KV_CLAIMS, history=1)
        await old.put("c1", b'{"claim":"c1"}')
        await js.add_stream(name=subjects.STREAM_CLAIMS, subjects=[f"{subjects.CLAIMS}.>"], max_age=3600.0)
        bus = await Bus.connect(BusSettings(url=nats_url, bucket_max_bytes=32 * 2**20), "translator")
        try:
            done = await bus.ensure_topology()
        finally:
            await bus.close()
        assert done[subjects.KV_CLAIMS] == "updated" and done[subjects.STREAM_CLAIMS] == "updated"
        bucket = (await js.stream_info(f"KV_{subjects.KV_CLAIMS}")).config
        assert (bucket.max_bytes, bucket.max_msgs_per_subject) == (32 * 2**20, 5)
        stream = (await js.stream_info(subjects.STREAM_CLAIMS)).config
        assert stream.max_age == 7 * 24 * 3600 and stream.max_bytes == 1024 * 2**20
        assert (await (await js.key_value(subjects.KV_CLAIMS)).get("c1")).value == b'{"claim":"c1"}'
    finally:
        await nc.close()


async def test_the_ledger_keeps_the_history_it_is_given_and_an_update_brings_it_there(nats_url):
    """TESSERA_LEDGER_HISTORY: an existing ledger bucket of 5 revisions per key is brought to 64 at
    the next start, the other buckets stay at 5, and a value past what NATS keeps is refused."""
    first = await Bus.connect(BusSettings(url=nats_url), "placement")
    try:
        await first.ensure_topology()
        assert (await first.stream_info(f"KV_{subjects.KV_LEDGER}")).config.max_msgs_per_subject == 5
    finally:
        await first.close()
    settings = BusSettings.from_env({"TESSERA_NATS_URL": nats_url, "TESSERA_LEDGER_HISTORY": "64"})
    bus = await Bus.connect(settings, "placement")
    try:
        done = await bus.ensure_topology()
        assert done[subjects.KV_LEDGER] == "updated"
        assert (await bus.stream_info(f"KV_{subjects.KV_LEDGER}")).config.max_msgs_per_subject == 64
        assert (await bus.stream_info(f"KV_{subjects.KV_CLAIMS}")).config.max_msgs_per_subject == 5
    finally:
        await bus.close()
    with pytest.raises(ConfigError, match="TESSERA_LEDGER_HISTORY"):
        BusSettings.from_env({"TESSERA_LEDGER_HISTORY": "65"})


async def test_more_replicas_than_servers_stops_the_service_naming_the_setting(nats_url):
    bus = await Bus.connect(BusSettings(url=nats_url, replicas=3), "placement")
    try:
        with pytest.raises(ConfigError, match="TESSERA_STREAM_REPLICAS=3 needs a JetStream cluster"):
            await bus.ensure_topology()
    finally:
        await bus.close()


async def test_a_reader_binds_and_never_creates(nats_url):
    bus = await Bus.connect(BusSettings(url=nats_url), "cli")
    try:
        with pytest.raises(topology.TopologyMissing, match="start the Tessera services first"):
            await bus.kv(subjects.KV_CLAIMS)
        assert await bus.streams_info() == []
    finally:
        await bus.close()


def test_tessera_status_against_an_empty_server_says_to_start_the_services(nats_url):
    tessera = Path(sys.executable).parent / "tessera"
    done = subprocess.run([str(tessera), "status", "--nats", nats_url], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "start the Tessera services first" in " ".join((done.stderr + done.stdout).split())  # (wrapped)
    assert "Traceback" not in done.stderr

    async def streams() -> list:
        nc, js = await _js(nats_url)
        try:
            return await js.streams_info()
        finally:
            await nc.close()

    assert asyncio.run(streams()) == []  # nothing was created at R1 (or at all) by looking


async def test_a_client_given_several_urls_connects_to_one_that_is_up(nats_url):
    dead = "nats://127.0.0.1:1"
    bus = await Bus.connect(BusSettings(url=f"{dead}, {nats_url}"), "cli")
    try:
        assert bus.connected
        assert bus.connected_url.port == int(nats_url.rsplit(":", 1)[1])
    finally:
        await bus.close()


def test_each_service_ensures_exactly_the_buckets_its_identity_may_manage():
    for service in identities.SERVICES:
        streams, buckets = identities.topology(service)
        assert set(buckets) <= set(TABLE.buckets) and set(streams) <= set(TABLE.streams)
        allowed = identities.permissions(service)["publish"]["allow"]
        for name in [*streams, *(f"KV_{b}" for b in buckets)]:
            assert f"$JS.API.STREAM.UPDATE.{name}" in allowed, (service, name)
    # Every bucket a service uses, read or written, so the start order does not matter: the manager
    # also reads claims and the ledger (a deleted tenant's claims are released first).
    assert identities.topology("controlplane")[1] == (subjects.KV_TENANTS, identities.KV_CONTROLPLANES,
                                                      identities.KV_SECRETS, subjects.KV_CLAIMS, subjects.KV_LEDGER)


async def test_moving_to_three_replicas_brings_existing_buckets_to_r3_too(tmp_path):
    """A deployment that ran at R1 on a cluster and is restarted with TESSERA_STREAM_REPLICAS=3:
    the streams *and* the KV buckets become R3 (the old code updated the streams only and left
    every bucket at R1, seen with it: KV_claims 1, KV_tenants 1, TESSERA_CLAIMS 3)."""
    auth = tmp_path / "auth"
    passwords = identities.write_auth_dir(auth, [])
    cluster = NatsCluster(tmp_path / "cluster", auth).start()
    try:
        url = ",".join(u.replace("nats://", f"nats://translator:{passwords['translator']}@")
                       for u in cluster.url.split(","))
        for replicas in (1, 3):
            bus = await Bus.connect(BusSettings(url=url, replicas=replicas), "translator")
            try:
                await bus.ensure_topology()
                streams, buckets = identities.topology("translator")
                for name in [*streams, *(f"KV_{b}" for b in buckets)]:
                    assert (await bus.stream_info(name)).config.num_replicas == replicas, name
            finally:
                await bus.close()
    finally:
        cluster.stop()
