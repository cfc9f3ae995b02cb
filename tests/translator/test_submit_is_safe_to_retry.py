"""A submit whose outcome the caller cannot know is safe to retry, and never strands its claim (issue 12, window 1).

The real TranslatorService's submit handler in this test's event loop, against a real nats-server.
The lost answers are played at the bus: a ``requested`` publish that lands but whose ack is lost,
one that never lands, a claims-bucket write that times out. Then: the caller has the claim id, the
same request again makes no second claim and no second event, and a record left ``requested``
without its event is republished by the translator's reconciler (both paths, API and Kubernetes).
"""

from __future__ import annotations

import msgspec
import nats
import pytest

from tessera.shared import api, subjects
from tessera.shared.bus import Bus
from tessera.shared.errors import TemporaryError
from tessera.shared.events import ClaimRecord, ClaimSpec, TenantRecord, claim_decoder, encode
from tessera.shared.kubeclaims import KubeClaimRef
from tessera.shared.runner import ServiceContext
from tessera.shared.settings import BusSettings, ServiceSettings
from tessera.shared.telemetry import Telemetry

from tessera.translator.service import TranslatorService, TranslatorSettings

_encoder = msgspec.json.Encoder()


@pytest.fixture
async def translator(nats_url):
    bus = await Bus.connect(BusSettings(url=nats_url), "translator")
    await bus.ensure_topology()
    ctx = ServiceContext(settings=ServiceSettings(service="translator", bus=BusSettings(url=nats_url)),
                         bus=bus, telemetry=Telemetry("translator", None))
    service = TranslatorService(ctx, TranslatorSettings())
    await service.open()
    await service.tenants.put("alpha", encode(TenantRecord(tenant="alpha")))
    yield service
    await bus.close()


def request(claim: str | None = None, mib: int = 1000) -> bytes:
    return _encoder.encode(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": mib}, claim=claim))


async def requested(service: TranslatorService) -> list:
    info = await service.bus.js.stream_info(subjects.STREAM_CLAIMS)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        msg = await service.bus.js.get_msg(subjects.STREAM_CLAIMS, seq)
        if subjects.event_name(msg.subject) == "requested":
            out.append(claim_decoder.decode(msg.data))
    return out


def fail_publish(service: TranslatorService, monkeypatch, *, lands: bool) -> None:
    real = service.bus.publish

    async def publish(*args, **kwargs):
        if lands:
            await real(*args, **kwargs)  # stored by the stream ...
        raise TemporaryError("publish timed out")  # ... but the ack never came back (or nothing went out)

    monkeypatch.setattr(service.bus, "publish", publish)


@pytest.mark.parametrize("lands", [True, False], ids=["publish-landed", "publish-lost"])
async def test_unknown_publish_outcome_gives_the_claim_id_and_a_retry_makes_one_claim(translator, monkeypatch, lands):
    fail_publish(translator, monkeypatch, lands=lands)
    reply = api.decode_reply(await translator.submit(request(), {}))
    assert not reply.ok and reply.error.code == "unavailable"
    claim = reply.error.claim
    assert claim and claim in reply.error.message
    monkeypatch.undo()

    again = api.decode_reply(await translator.submit(request(claim), {}))
    assert again.ok and again.result["claim"] == claim
    events = await requested(translator)
    assert [e.claim for e in events] == [claim]  # one event whichever way the first publish went
    assert len(await translator.claims.all()) == 1


async def test_claims_bucket_timeout_is_answered_not_dropped(translator, monkeypatch):
    async def create(record):
        raise nats.errors.TimeoutError()

    monkeypatch.setattr(translator.claims, "create", create)
    reply = api.decode_reply(await translator.submit(request("c-timeout"), {}))
    assert not reply.ok and reply.error.code == "unavailable" and reply.error.claim == "c-timeout"


async def test_a_retry_with_other_content_under_the_same_id_is_refused(translator):
    assert api.decode_reply(await translator.submit(request("c-same"), {})).ok
    reply = api.decode_reply(await translator.submit(request("c-same", mib=2000), {}))
    assert not reply.ok and reply.error.code == "conflict" and reply.error.field == "claim"
    events = await requested(translator)
    assert [e.spec.memory_mib for e in events] == [1000]


async def test_records_left_requested_without_their_event_are_republished(translator, monkeypatch):
    fail_publish(translator, monkeypatch, lands=False)
    reply = api.decode_reply(await translator.submit(request(), {}))
    api_claim = reply.error.claim
    monkeypatch.undo()
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


async def test_cli_retries_an_unavailable_submit_under_the_id_it_chose(translator, monkeypatch, nats_url):
    import asyncio

    from tessera.cli.client import Client

    real = translator.bus.publish
    seen: list[str | None] = []

    async def publish_ack_lost_once(*args, **kwargs):
        await real(*args, **kwargs)
        if len(seen) == 1:
            raise TemporaryError("publish timed out")

    monkeypatch.setattr(translator.bus, "publish", publish_ack_lost_once)

    async def submit(data, headers):
        seen.append(msgspec.json.decode(data).get("claim"))
        return await translator.submit(data, headers)

    server = asyncio.create_task(translator.bus.serve(subjects.API_SUBMIT, submit))
    client = await Client.connect(nats_url)
    try:
        await asyncio.sleep(0.2)  # subscribed
        result = await client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": 1000}))
    finally:
        await client.close()
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
    assert len(seen) == 2 and seen[0] == seen[1] == result["claim"]
    assert [e.claim for e in await requested(translator)] == [result["claim"]]
