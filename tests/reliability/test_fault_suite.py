"""The fault suite's short form: a few scenarios under load, and the auditor finds nothing.

The long form (every scenario, longer load) is `make reliability`, which writes
bench/reliability.md. Here each test runs one scenario on a fresh local Tessera with a few dozen
claims and asserts the auditor's findings are empty: zero lost, zero duplicated, zero
over-committed, consumers drained, dead letters with their reasons, the services still running.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))

import scenarios  # noqa: E402


# lost-kv-reply failed on main (issue 12 windows 3 and 6: the committed write whose reply was lost
# was placed again on the other node, one ledger revision holding the claim on two nodes); it passes
# with life-core's and life-edges' fixes merged.
SHORT_FORM = ["bad-events", "lost-kv-reply"]


@pytest.mark.parametrize("name", SHORT_FORM)
async def test_no_claim_is_lost_duplicated_or_overcommitted_under_the_fault(name, tmp_path):
    row = await scenarios.run(name, tmp_path / name, scenarios.Form.short())
    assert row.accepted > 0 and row.revisions > 0, "the load did not reach the system"
    assert row.findings == []
    assert (row.lost, row.duplicated, row.overcommitted) == (0, 0, 0)
    assert row.recover_seconds is not None
