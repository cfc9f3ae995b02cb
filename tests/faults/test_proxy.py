"""The fault proxy makes the faults the suite needs: a KV write that commits but whose reply is lost.

These tests pin what the scenarios rely on: bytes pass unchanged, a dropped reply direction turns a
committed write into a timeout for the writer, and after ``cut`` + ``passthrough`` the client
reconnects through the same proxy.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeout

from proxy import DOWNSTREAM, UPSTREAM, FaultProxy


async def _kv(url: str, bucket: str = "faults"):
    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    js = nc.jetstream(timeout=1.0)
    try:
        kv = await js.key_value(bucket)
    except Exception:
        kv = await js.create_key_value(bucket=bucket)
    return nc, kv


async def test_bytes_pass_unchanged_through_the_proxy(nats_url):
    with FaultProxy(int(nats_url.rsplit(":", 1)[1])) as proxy:
        nc, kv = await _kv(proxy.url)
        try:
            await kv.put("k", b"value")
            assert (await kv.get("k")).value == b"value"
            assert proxy.directions[UPSTREAM].bytes_seen > 0 and proxy.directions[DOWNSTREAM].bytes_seen > 0
        finally:
            await nc.close()


async def test_a_kv_write_whose_reply_is_lost_commits_but_times_out(nats_url):
    direct, direct_kv = await _kv(nats_url)
    with FaultProxy(int(nats_url.rsplit(":", 1)[1])) as proxy:
        nc, kv = await _kv(proxy.url)
        try:
            proxy.drop(DOWNSTREAM)
            with pytest.raises(NatsTimeout):
                await kv.put("lost-reply", b"committed")
            # The server committed the write although its writer never heard so.
            assert (await direct_kv.get("lost-reply")).value == b"committed"
            assert proxy.directions[DOWNSTREAM].bytes_dropped > 0
        finally:
            proxy.passthrough()
            await nc.close()
            await direct.close()


async def test_cut_closes_connections_and_the_client_reconnects(nats_url):
    with FaultProxy(int(nats_url.rsplit(":", 1)[1])) as proxy:
        nc, kv = await _kv(proxy.url)
        try:
            before = proxy.connections_accepted
            proxy.cut()
            for _ in range(100):
                if proxy.connections_accepted > before and nc.is_connected:
                    break
                await asyncio.sleep(0.05)
            assert proxy.connections_accepted > before
            await kv.put("after-cut", b"ok")
            assert (await kv.get("after-cut")).value == b"ok"
        finally:
            await nc.close()


async def test_delay_holds_traffic_without_losing_it(nats_url):
    with FaultProxy(int(nats_url.rsplit(":", 1)[1])) as proxy:
        nc, kv = await _kv(proxy.url)
        try:
            proxy.delay(DOWNSTREAM, 0.3)
            await kv.put("slow", b"late", )
            proxy.passthrough()
            assert (await kv.get("slow")).value == b"late"
        finally:
            await nc.close()


async def test_replies_are_dropped_from_the_write_that_carries_the_marker(nats_url):
    direct, direct_kv = await _kv(nats_url)
    with FaultProxy(int(nats_url.rsplit(":", 1)[1])) as proxy:
        nc, kv = await _kv(proxy.url)
        try:
            proxy.drop_replies_after(b"$KV.faults.marked")
            await kv.put("unmarked", b"answered")
            assert not proxy.triggered.is_set()
            with pytest.raises(NatsTimeout):
                await kv.put("marked", b"committed")
            assert proxy.triggered.is_set()
            assert (await direct_kv.get("marked")).value == b"committed"
        finally:
            proxy.passthrough()
            await nc.close()
            await direct.close()


async def test_drop_from_loses_the_marked_write_itself(nats_url):
    direct, direct_kv = await _kv(nats_url)
    with FaultProxy(int(nats_url.rsplit(":", 1)[1])) as proxy:
        nc, kv = await _kv(proxy.url)
        try:
            proxy.drop_from(b"$KV.faults.marked")
            await kv.put("unmarked", b"answered")
            with pytest.raises(NatsTimeout):
                await kv.put("marked", b"never arrives")
            assert proxy.triggered.is_set()
            assert proxy.directions[UPSTREAM].bytes_dropped > 0
            with pytest.raises(nats.js.errors.KeyNotFoundError):  # the server never saw it
                await direct_kv.get("marked")
        finally:
            proxy.passthrough()
            await nc.close()
            await direct.close()
