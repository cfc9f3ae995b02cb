"""The one rule that decides a handled message's fate (`tessera.shared.subscriptions.verdict`), and
the subscriptions that refuse to be declared wrong."""

from __future__ import annotations

import pytest

from tessera.shared.errors import ConflictError, PermanentError, TemporaryError
from tessera.shared.events import claim_decoder
from tessera.shared.subscriptions import (
    ACK,
    CONFLICT_REDELIVERY_DELAY,
    BatchSubscription,
    Subscription,
    verdict,
)


async def _handler(event, delivery) -> None:
    return None


def test_done_is_acked():
    assert verdict(None, 1, 3) is ACK


def test_a_permanent_error_is_dead_lettered_at_once_with_its_reason():
    assert verdict(PermanentError("tenant is gone"), 1, 3).action == "dead-letter"
    assert verdict(PermanentError("tenant is gone"), 1, 3).reason == "tenant is gone"


def test_a_temporary_error_is_redelivered_after_its_delay_until_the_last_delivery():
    first = verdict(TemporaryError("peer down", delay=0.05), 1, 3)
    assert (first.action, first.delay, first.reason, first.routine) == ("redeliver", 0.05, "peer down", False)
    last = verdict(TemporaryError("peer down", delay=0.05), 3, 3)
    assert (last.action, last.reason) == ("dead-letter", "gave up after 3 deliveries: peer down")


def test_an_unexpected_error_backs_off_and_names_its_type():
    v = verdict(ValueError("the node directory is not writable"), 2, 5)
    assert v.action == "redeliver" and v.delay == 0.8
    assert v.reason == "ValueError: the node directory is not writable"
    assert verdict(ValueError("x"), 10, 20).delay == 10  # capped


def test_a_conflict_that_reaches_settlement_is_redelivered_at_once_as_a_routine_race():
    v = verdict(ConflictError("c-1: the record moved"), 1, 3)
    assert (v.action, v.delay, v.routine) == ("redeliver", CONFLICT_REDELIVERY_DELAY, True)
    last = verdict(ConflictError("c-1: the record moved"), 3, 3)
    assert last.action == "dead-letter" and last.reason == "gave up after 3 deliveries: compare-and-set lost: c-1: the record moved"


@pytest.mark.parametrize("wrong,message", [
    (dict(filter_subjects=[]), "filter_subjects must be a non-empty list"),
    (dict(filter_subjects="tessera.claims.>"), "filter_subjects must be a non-empty list"),
    (dict(batch=0), "batch must be at least 1"),
    (dict(max_deliver=0), "max_deliver must be at least 1"),
    (dict(concurrency=0), "concurrency must be at least 1"),
    (dict(durable=""), "stream and durable must be named"),
])
def test_a_subscription_declared_wrong_says_what_is_wrong(wrong, message):
    what = dict(stream="CLAIMS", durable="probe", filter_subjects=["tessera.claims.>"], decoder=claim_decoder,
                handler=_handler)
    with pytest.raises(ValueError, match=message):
        Subscription(**{**what, **wrong})


def test_a_batch_subscription_has_no_concurrency_of_its_own():
    with pytest.raises(TypeError):
        BatchSubscription(stream="CLAIMS", durable="probe", filter_subjects=["x"], decoder=claim_decoder,
                          handler=_handler, concurrency=4)
