"""Adding an event is one place: its Struct in tessera.shared.events, written into its family's union.

The rest follows from the union: the family's decoder reads the new ``kind``, the AsyncAPI document
carries its message and schema, and the lists of kinds the tests draw from include it. These tests
walk every event the module declares, so one that was declared and left out of its union fails here,
with the fix in the message; a planted omission shows that the check catches it.
"""

from __future__ import annotations

import json

import msgspec

from tessera.shared import asyncapi, events


def declared_events(module=events) -> list[type[events.Event]]:
    """The concrete events ``module`` declares: its subclasses of `events.Event` that no class of
    the module extends (a family's base, such as `events.ClaimEventBase`, is not one)."""
    found: list[type[events.Event]] = []
    stack = list(events.Event.__subclasses__())
    while stack:
        cls = stack.pop()
        own = [s for s in cls.__subclasses__() if s.__module__ == module.__name__]
        stack += cls.__subclasses__()
        if cls.__module__ == module.__name__ and not own:
            found.append(cls)
    return sorted(found, key=lambda c: c.__name__)


def family_decoders(module=events) -> list[msgspec.json.Decoder]:
    """Every decoder the module builds (one per subject family)."""
    return [v for v in vars(module).values() if isinstance(v, msgspec.json.Decoder)]


def not_in_a_union(declared, decoders) -> list[str]:
    """What is wrong with each declared event that no family decoder (or more than one) reads."""
    problems = []
    for cls in declared:
        readers = [d for d in decoders if cls in events.members(d.type)]
        if len(readers) != 1:
            problems.append(
                f"{cls.__name__} (kind {cls.__struct_config__.tag!r}) is read by {len(readers)} family decoders, "
                "not one: write it into its family's union in tessera.shared.events (ClaimEvent, "
                "InventoryEvent, UsageEvent, TenantEvent or DlqEvent), then run 'make docs'")
    return problems


def test_every_declared_event_is_in_exactly_one_family_union():
    assert declared_events(), "found no events: the walk over tessera.shared.events is broken"
    assert not_in_a_union(declared_events(), family_decoders()) == []


def test_an_event_left_out_of_its_union_is_named_with_the_fix():
    class ClaimPaused(events.ClaimEventBase, tag="paused"):
        reason: str = ""

    (problem,) = not_in_a_union([ClaimPaused], family_decoders())
    assert "ClaimPaused" in problem and "'paused'" in problem and "union" in problem


def test_each_family_decoder_reads_the_kind_of_every_event_in_its_union():
    for decoder in family_decoders():
        for cls in events.members(decoder.type):
            kind = cls.__struct_config__.tag
            try:
                value = decoder.decode(json.dumps({"kind": kind}).encode())
            except msgspec.ValidationError as exc:
                # The kind was recognised: what is missing is the event's own required fields.
                assert "missing required field" in str(exc), f"{kind!r}: {exc}"
            else:
                assert type(value) is cls


def test_every_declared_event_has_its_message_and_schema_in_the_asyncapi_document():
    doc = json.loads(asyncapi.render())
    messages, schemas = doc["components"]["messages"], doc["components"]["schemas"]
    for cls in declared_events():
        name, kind = cls.__name__, cls.__struct_config__.tag
        assert name in messages, f"{name} has no message in the AsyncAPI document"
        assert messages[name]["title"].endswith(f": {kind}")
        assert name in schemas


def test_the_claim_channel_lists_every_claim_kind():
    doc = json.loads(asyncapi.render())
    description = doc["channels"]["claims"]["description"]
    assert f"Claim lifecycle: {', '.join(events.CLAIM_EVENT_KINDS)}." in description
