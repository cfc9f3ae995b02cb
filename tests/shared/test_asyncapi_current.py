"""The AsyncAPI document of the subjects is generated from the code and must be current."""

from pathlib import Path

from tessera.shared.asyncapi import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "asyncapi.json"


def test_checked_in_asyncapi_matches_the_structs():
    assert DOC.exists(), "docs/asyncapi.json is missing: run 'tessera asyncapi'"
    assert DOC.read_text() == render(), "docs/asyncapi.json is out of date: run 'tessera asyncapi'"


def test_every_claim_event_kind_has_a_message():
    import json

    doc = json.loads(render())
    titles = {m.get("title", "") for m in doc["components"]["messages"].values()}
    for kind in ("requested", "allocated", "unschedulable", "prepared", "running", "released", "failed"):
        assert f"claims: {kind}" in titles
