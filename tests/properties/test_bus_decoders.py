"""No bytes on the bus crash a decoder: every bus event, API request and KV record decoder either
returns its Struct or raises msgspec's DecodeError (ValidationError is one), which the consumers turn
into a dead letter and the APIs into an "invalid" reply. What decodes re-encodes to the same value."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.shared import api, asyncapi, events

from strategies import json_values, shaped

DECODERS = {
    "inventory": events.inventory_decoder,
    "claim": events.claim_decoder,
    "usage": events.usage_decoder,
    "tenant": events.tenant_decoder,
    "dlq": events.dlq_decoder,
    "submit-request": msgspec.json.Decoder(api.SubmitRequest),
    "release-request": msgspec.json.Decoder(api.ReleaseRequest),
    "tenant-request": msgspec.json.Decoder(api.TenantRequest),
    "reply": msgspec.json.Decoder(api.Reply),
    "claim-record": msgspec.json.Decoder(events.ClaimRecord),
    "tenant-record": msgspec.json.Decoder(events.TenantRecord),
    "node-ledger": msgspec.json.Decoder(events.NodeLedger),
    "tenant-usage": msgspec.json.Decoder(events.TenantUsage),
    "node-inventory": msgspec.json.Decoder(events.NodeInventory),
}
# Every family's kinds, from the unions the AsyncAPI document is made of (a new event is drawn too).
KINDS = sorted({kind for *_, union, _ in asyncapi.FAMILIES for kind in events.kinds(union)})


def _decodes_or_refuses(decoder, data: bytes) -> None:
    try:
        value = decoder.decode(data)
    except msgspec.DecodeError as exc:
        assert str(exc), "a refusal must say what is wrong"
        if " - at `" in str(exc):
            message, path = api.describe_validation_error(exc)
            assert message and path.startswith("$")
        return
    again = decoder.decode(msgspec.json.encode(value))
    assert msgspec.json.encode(again) == msgspec.json.encode(value)


@pytest.mark.parametrize("name", sorted(DECODERS))
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_decode_or_are_refused(name, data):
    _decodes_or_refuses(DECODERS[name], data)


@pytest.mark.parametrize("name", sorted(DECODERS))
@given(value=json_values | shaped(KINDS))
def test_arbitrary_json_decodes_or_is_refused(name, value):
    try:
        data = json.dumps(value).encode()
    except ValueError:  # NaN and infinities are not JSON; json.dumps writes them anyway unless told
        return
    _decodes_or_refuses(DECODERS[name], data)
