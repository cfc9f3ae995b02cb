"""`tessera dlq list|replay` against a real nats-server: a letter goes back to its subject once.

The letters are written by the bus's own dead-letter path (Bus.dead_letter, what a service's
consumer does when it gives up). Replaying republishes the original subject and payload; two
replays at once store one message (Nats-Msg-Id), and a replay after the stream's duplicate window
has passed finds the mark the first one left and sends nothing.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.settings import BusSettings

from tessera.cli import dlq, exitcodes
from tessera.cli.client import Client

from clikit import tessera

WINDOW = 2.0  # the streams' duplicate window here (production: 120 s)
PAYLOAD = b'{"kind": "requested", "claim": "c-dlq", "tenant": "alpha", "spec": {"gpus": 1}}'


async def claim_messages(bus: Bus, subject: str) -> list[bytes]:
    info = await bus.stream_info(subjects.STREAM_CLAIMS, subjects_filter=subject)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await bus.stored_message(subjects.STREAM_CLAIMS, seq)
        except Exception:
            continue
        if msg.subject == subject:
            out.append(msg.data)
    return out


@pytest.fixture
async def letters(nats_url):
    # A short duplicate window, so the test can get past it: then only the replay mark prevents a double.
    tool = await Bus.connect(BusSettings(url=nats_url, duplicate_window=WINDOW), "cli")
    await tool.ensure_topology()
    await tool.close()
    bus = await Bus.connect(BusSettings(url=nats_url, duplicate_window=WINDOW), "placement")
    subject = subjects.claim("alpha", "c-dlq", "requested")
    await bus.dead_letter(subject, PAYLOAD, "invalid payload: tenant alpha did not exist yet", 1,
                          stream=subjects.STREAM_CLAIMS, seq=7)
    await bus.dead_letter("", b"", "gave up after 5 deliveries", 5, stream=subjects.STREAM_CLAIMS, seq=8)
    yield bus, subject
    await bus.close()


async def test_list_shows_the_letters(nats_url, letters):
    ran = await tessera("dlq", "list", "--nats", nats_url, "-o", "json")
    assert ran.code == exitcodes.OK, ran.err
    listed = json.loads(ran.out)
    assert [(x["service"], x["subject"], x["replayed"]) for x in listed] == [
        ("placement", letters[1], False), ("placement", "", False)]
    assert json.loads(listed[0]["payload"]) == json.loads(PAYLOAD)
    ran = await tessera("dlq", "list", "--nats", nats_url, "--service", "enforcer", "-o", "json")
    assert json.loads(ran.out) == []
    table = await tessera("dlq", "list", "--nats", nats_url)
    assert table.code == exitcodes.OK and "dead letters (2)" in table.out and "placement" in table.out


async def test_replay_sends_the_letter_back_once(nats_url, letters):
    bus, subject = letters
    client = await Client.connect(nats_url)
    try:
        seq = (await dlq.read_letters(client))[0].seq
        # two replays at once: one message
        results = await asyncio.gather(dlq.replay(client, seq), dlq.replay(client, seq))
        assert sorted(r["replayed"] for r in results) == [False, True], results
        assert await claim_messages(bus, subject) == [PAYLOAD]
        await asyncio.sleep(WINDOW + 0.5)  # past the duplicate window: only the mark stops a double now
        ran = await tessera("dlq", "replay", "--nats", nats_url, str(seq), "-o", "json")
        assert ran.code == exitcodes.OK, ran.err
        assert json.loads(ran.out) == [{"seq": seq, "subject": subject, "replayed": False, "already_replayed": True}]
        assert await claim_messages(bus, subject) == [PAYLOAD]
        listed = await dlq.read_letters(client)
        assert listed[0].replayed and listed[0].replayed_at is not None and listed[0].replayed_seq
        # --force sends it again, on purpose
        forced = await dlq.replay(client, seq, force=True)
        assert forced["replayed"]
        assert await claim_messages(bus, subject) == [PAYLOAD, PAYLOAD]
        # a letter that does not know its subject cannot be replayed, and says why
        ran = await tessera("dlq", "replay", "--nats", nats_url, str(listed[1].seq))
        assert ran.code == exitcodes.FAILED and "does not say which subject" in ran.err
    finally:
        await client.close()
