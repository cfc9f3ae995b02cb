"""A publish JetStream has not taken *yet* is a temporary error, not a crash.

In a cluster whose stream leader moves, a retried publish can be answered 409 "duplicate message id
is in process" (err_code 10158: the first attempt is still being stored) or 503; seen for real in
tests/reliability/test_nats_cluster.py, where it ended an enforcer's observe loop and the process.
The answer is forced here on a real server's connection (the race itself needs a cluster).
"""

from __future__ import annotations

import pytest
from nats.js.errors import APIError

from tessera.shared import subjects
from tessera.shared.errors import TemporaryError
from tessera.shared.events import ClaimReleaseRequested
from tessera.shared.jspub import PublishError


@pytest.mark.parametrize("code,err_code", [(409, 10158), (503, 0)])
async def test_a_publish_not_taken_yet_is_temporary(bus, monkeypatch, code, err_code):
    async def refused(*args, **kwargs):
        raise APIError(code=code, err_code=err_code, description="duplicate message id is in process")

    monkeypatch.setattr(bus._js, "publish", refused)
    with pytest.raises(TemporaryError, match="retry"):
        await bus.publish(subjects.claim("t", "c1", "released", "n"), ClaimReleaseRequested(claim="c1", tenant="t"),
                          msg_id="c1:released")


def test_a_pipelined_publish_not_taken_yet_says_so():
    assert PublishError("s", "duplicate message id is in process", 409, 10158).not_now
    assert PublishError("s", "unavailable", 503, 0).not_now
    assert not PublishError("s", "wrong last sequence", 400, 10071).not_now


async def test_a_publish_refused_for_good_still_raises_what_it_was(bus, monkeypatch):
    async def refused(*args, **kwargs):
        raise APIError(code=400, err_code=10054, description="maximum messages exceeded")

    monkeypatch.setattr(bus._js, "publish", refused)
    with pytest.raises(APIError):
        await bus.publish(subjects.claim("t", "c1", "released", "n"), ClaimReleaseRequested(claim="c1", tenant="t"))
