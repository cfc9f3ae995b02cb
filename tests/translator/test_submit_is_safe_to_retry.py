"""A submit whose outcome the caller cannot know is safe to retry, and never strands its claim (issue 12, window 1).

The real TranslatorService's submit handler in this test's event loop, against a real nats-server
that it reaches through a TCP proxy (tests/faults/proxy.py): the lost answers are lost on the wire.
A ``requested`` publish that reaches the stream but whose ack never comes back, one that never
reaches it, a claims-bucket write that commits but whose reply is lost, and (a second proxy, in
front of the CLI) a submit whose reply to the caller is lost. Then: the caller has the claim id, the
same request again makes no second claim and no second event, and a record left ``requested``
without its event is republished by the translator's reconciler (both paths, API and Kubernetes).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec
import pytest

from tessera.shared import api, subjects
from tessera.shared.bus import Bus
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.events import ClaimRecord, ClaimSpec, TenantRecord, claim_decoder, encode
from tessera.shared.kubeclaims import KubeClaimRef
from tessera.shared.runner import ServiceContext
from tessera.shared.settings import BusSettings, ServiceSettings
from tessera.shared.telemetry import Telemetry

from tessera.translator.service import TranslatorService, TranslatorSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))

from proxy import FaultProxy  # noqa: E402
from kit import eventually  # noqa: E402

_encoder = msgspec.json.Encoder()
# What the translator sends when it publishes a claim event of tenant alpha (the ``requested`` of a
# submit): nothing else it sends (the record's KV write, reads) carries it.
REQUESTED_OF_ALPHA = f"{subjects.CLAIMS}.alpha.".encode()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture
async def proxy(nats_url):
    with FaultProxy(_port(nats_url)) as p:
        yield p


@pytest.fixture
async def translator(proxy):
    settings = BusSettings(url=proxy.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    bus = await Bus.connect(settings, "translator")
    await bus.ensure_topology()
    ctx = ServiceContext(settings=ServiceSettings(service="translator", bus=settings),
                         bus=bus, telemetry=Telemetry("translator", None))
    service = TranslatorService(ctx, TranslatorSettings())
    await service.open()
    await service.tenants.put("alpha", encode(TenantRecord(tenant="alpha")))
    yield service
    await bus.close()


async def heal(proxy: FaultProxy, bus: Bus) -> None:
    """Let traffic pass again and drop the connections that lost it: the client reconnects."""
    before = proxy.connections_accepted
    proxy.passthrough()
    proxy.cut()
    await eventually(lambda: proxy.connections_accepted > before and bus.connected, timeout=20, every=0.05,
                     what="the client reconnected through the proxy")


def request(claim: str | None = None, mib: int = 1000) -> bytes:
    return _encoder.encode(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": mib}, claim=claim))


async def requested(service: TranslatorService) -> list:
    info = await service.bus.stream_info(subjects.STREAM_CLAIMS)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        msg = await service.bus.stored_message(subjects.STREAM_CLAIMS, seq)
        if subjects.event_name(msg.subject) == "requested":
            out.append(claim_decoder.decode(msg.data))
    return out


def lose_publish(proxy: FaultProxy, *, lands: bool) -> None:
    """The next ``requested`` publish reaches the stream and its ack is lost (``lands``), or it is
    lost on its way there; either way the translator's publish times out."""
    if lands:
        proxy.drop_replies_after(REQUESTED_OF_ALPHA)
    else:
        proxy.drop_from(REQUESTED_OF_ALPHA)


@pytest.mark.parametrize("lands", [True, False], ids=["publish-landed", "publish-lost"])
async def test_unknown_publish_outcome_gives_the_claim_id_and_a_retry_makes_one_claim(translator, proxy, lands):
    lose_publish(proxy, lands=lands)
    reply = api.decode_reply(await translator.submit(request(), {}))
    assert proxy.triggered.is_set()
    assert not reply.ok and reply.error.code == "unavailable"
    claim = reply.error.claim
    assert claim and claim in reply.error.message
    await heal(proxy, translator.bus)

    again = api.decode_reply(await translator.submit(request(claim), {}))
    assert again.ok and again.result["claim"] == claim
    events = await requested(translator)
    assert [e.claim for e in events] == [claim]  # one event whichever way the first publish went
    assert len(await translator.claims.all()) == 1


async def test_claims_bucket_timeout_is_answered_not_dropped(translator, proxy):
    # The record's write commits; its reply is lost: the translator cannot know it recorded the claim.
    proxy.drop_replies_after(f"$KV.{subjects.KV_CLAIMS}.c-timeout".encode())
    reply = api.decode_reply(await translator.submit(request("c-timeout"), {}))
    assert proxy.triggered.is_set()
    assert not reply.ok and reply.error.code == "unavailable" and reply.error.claim == "c-timeout"
    await heal(proxy, translator.bus)

    again = api.decode_reply(await translator.submit(request("c-timeout"), {}))
    assert again.ok and again.result["claim"] == "c-timeout"
    assert [e.claim for e in await requested(translator)] == ["c-timeout"]
    assert [r.claim for r in await translator.claims.all()] == ["c-timeout"]


async def test_a_retry_with_other_content_under_the_same_id_is_refused(translator):
    assert api.decode_reply(await translator.submit(request("c-same"), {})).ok
    reply = api.decode_reply(await translator.submit(request("c-same", mib=2000), {}))
    assert not reply.ok and reply.error.code == "conflict" and reply.error.field == "claim"
    events = await requested(translator)
    assert [e.spec.memory_mib for e in events] == [1000]


async def test_records_left_requested_without_their_event_are_republished(translator, proxy):
    lose_publish(proxy, lands=False)
    reply = api.decode_reply(await translator.submit(request(), {}))
    api_claim = reply.error.claim
    await heal(proxy, translator.bus)
    # The Kubernetes path's crash window: a translator killed after writing the record.
    kube = ClaimRecord(claim="k-1", tenant="alpha", state="requested", spec=ClaimSpec(memory_mib=500),
                       kube=KubeClaimRef(namespace="ns", name="rc", uid="u-1"))
    await translator.claims.create(kube)
    assert await translator.republish_requested() == []  # younger than the grace: maybe on its way

    sent = await translator.republish_requested(grace=0)
    assert sorted(sent) == sorted([api_claim, "k-1"])
    events = {e.claim: e for e in await requested(translator)}
    assert events["k-1"].kube is not None and events["k-1"].spec.memory_mib == 500
    record, revision = await translator.claims.get(api_claim)
    assert events[api_claim].record_revision == revision and events[api_claim].spec == record.spec
    assert await translator.republish_requested(grace=0) == []  # the stream has them now


async def test_cli_retries_a_submit_whose_reply_is_lost_under_the_id_it_chose(translator, nats_url):
    """The caller's side of window 1: the translator recorded and requested the claim, and its
    answer never reaches the CLI (lost between NATS and the CLI); the CLI's retry, under the claim
    id it chose before the first attempt, finds the claim instead of making a second one."""
    from tessera.cli.client import Client

    seen: list[str | None] = []
    answered = asyncio.Event()

    async def submit(data, headers):
        seen.append(msgspec.json.decode(data).get("claim"))
        try:
            return await translator.submit(data, headers)
        finally:
            answered.set()

    server = asyncio.create_task(translator.bus.serve(subjects.API_SUBMIT, submit))
    with FaultProxy(_port(nats_url)) as cli_proxy:
        client = await Client.connect(cli_proxy.url)
        healer = None
        try:
            await asyncio.sleep(0.2)  # subscribed
            cli_proxy.drop_replies_after(subjects.API_SUBMIT.encode())

            async def heal_after_the_first_answer():
                await answered.wait()
                # the answer went out, and was dropped on its way to the CLI
                await eventually(lambda: cli_proxy.directions["to_client"].bytes_dropped, timeout=4, every=0.01)
                await heal(cli_proxy, client.bus)

            healer = asyncio.create_task(heal_after_the_first_answer())
            result = await client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": 1000}),
                                         timeout=2.0)
            await healer
        finally:
            if healer is not None:
                await cancel_and_wait([healer])
            await client.close()
            await cancel_and_wait([server])
    assert cli_proxy.triggered.is_set() and cli_proxy.directions["to_client"].bytes_dropped > 0
    assert len(seen) == 2 and seen[0] == seen[1] == result["claim"]
    assert [e.claim for e in await requested(translator)] == [result["claim"]]
    assert len(await translator.claims.all()) == 1
