"""A three-member NATS cluster loses the claims stream's leader, then the ledger bucket's, under load:
every claim reaches a final state, none is allocated twice, nothing over-commits, and a claim
submitted right after each kill goes through. The long form with its figures is
`python tests/faults/clusterfaults.py` (bench/nats_cluster.md)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))

import clusterfaults  # noqa: E402


# nats-py 2.16 leaks the socket of a reconnect attempt whose handshake fails (a member being killed or
# restarting): Client._attempt_reconnect opens a new transport without closing the failed one, and the
# StreamWriter is reported at garbage collection. That one warning, from the test's own clients, is
# not this test's subject; any other stays an error. The same leak shows as the unclosed socket. Both
# are collected here, before the test ends (CI saw them reported against later tests when the
# collector got to them minutes after).
@pytest.mark.filterwarnings("ignore:Exception ignored in. <function StreamWriter.__del__:pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning")
async def test_killing_the_stream_and_kv_leaders_loses_and_duplicates_no_claim(tmp_path):
    try:
        result = await clusterfaults.run(tmp_path / "cluster", clusterfaults.Form.short())
    finally:
        gc.collect()
    print(clusterfaults.table(result))
    assert result.accepted > 0 and result.revisions > 0, "the load did not reach the system"
    assert [k.killed != k.new_leader for k in result.kills] == [True, True]
    assert all(k.claim_seconds is not None for k in result.kills)
    assert result.findings == []
    assert (result.lost, result.duplicated, result.overcommitted) == (0, 0, 0)
    assert result.settle_seconds is not None
