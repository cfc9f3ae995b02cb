"""The AsyncAPI document of the subjects is generated from the code and must be current; so must the
README's table of subjects, the one list of kinds written by hand."""

import json
import re
from pathlib import Path

from tessera.shared import asyncapi, events
from tessera.shared.asyncapi import render

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "asyncapi.json"


def test_checked_in_asyncapi_matches_the_structs():
    assert DOC.exists(), "docs/asyncapi.json is missing: run 'make docs' (or 'tessera asyncapi')"
    assert DOC.read_text() == render(), "docs/asyncapi.json is out of date: run 'make docs' (or 'tessera asyncapi')"


def test_every_claim_event_kind_has_a_message():
    doc = json.loads(render())
    titles = {m.get("title", "") for m in doc["components"]["messages"].values()}
    for kind in events.CLAIM_EVENT_KINDS:
        assert f"claims: {kind}" in titles


def _readme_kinds_by_stream() -> dict[str, set[str]]:
    """stream -> the kinds the README's "Subjects" table lists for it (its rows' third column)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Subjects", 1)[1].split("\n## ", 1)[0]
    found: dict[str, set[str]] = {}
    for row in (line for line in section.splitlines() if line.startswith("|")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`TESSERA_"):
            found.setdefault(cells[1].strip("`"), set()).update(re.findall(r"`([a-z-]+)`", cells[2]))
    return found


def test_the_readme_subjects_table_lists_every_kind_of_every_stream():
    declared: dict[str, set[str]] = {}
    for _, _, stream, union, _ in asyncapi.FAMILIES:
        declared.setdefault(stream, set()).update(events.kinds(union))
    assert _readme_kinds_by_stream() == declared, (
        "README.md's 'Subjects' table is out of step with tessera.shared.events: list each stream's kinds there")
