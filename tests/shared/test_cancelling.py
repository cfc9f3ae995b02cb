"""Stopping tasks for sure (`tessera.shared.cancelling`): a task that lives through its cancel is
cancelled again until it ends, and so is a service's root task (`runner.run_tasks`).

The first test shows why: on Python 3.11 ``asyncio.wait_for`` returns its future's result instead
of raising when the cancel and the result arrive together (what nats-py's request does under every
KV call). That is what hung tests/kubernetes/test_tenantcontrolplane.py in teardown: the manager's
readiness watch, cancelled while a KV reply came in, went back to watching, and the fixture's
``await task`` never returned.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.runner import run_tasks


async def watch_forever(reply: asyncio.Future, lived: list[str]) -> None:
    """A loop like the manager's watch: one request awaited through wait_for, then on forever."""
    await asyncio.wait_for(reply, 10)
    lived.append("lived through its cancel")
    while True:
        await asyncio.sleep(3600)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for raises the cancel")
async def test_on_311_a_cancel_that_meets_a_reply_in_wait_for_is_lost():
    reply = asyncio.get_running_loop().create_future()
    lived: list[str] = []
    task = asyncio.create_task(watch_forever(reply, lived))
    await asyncio.sleep(0)  # the task waits for its reply
    reply.set_result(b"ok")
    task.cancel()  # ... which comes in with the cancel
    await asyncio.sleep(0.05)
    assert lived == ["lived through its cancel"] and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_cancel_and_wait_ends_a_task_that_lived_through_its_cancel():
    reply = asyncio.get_running_loop().create_future()
    lived: list[str] = []
    stubborn = asyncio.create_task(watch_forever(reply, lived), name="watch")
    plain = asyncio.create_task(asyncio.sleep(3600), name="sleep")
    await asyncio.sleep(0)
    reply.set_result(b"ok")
    slow: list[str] = []
    await cancel_and_wait([stubborn, plain], grace=0.01, on_slow=lambda t: slow.append(t.get_name()))
    assert stubborn.cancelled() and plain.cancelled()
    if lived:  # (3.11: the first cancel was lost, and the task was named as slow)
        assert slow == ["watch"]


async def test_a_root_task_that_lives_through_its_cancel_does_not_keep_the_service_from_stopping(monkeypatch):
    import tessera.shared.runner as runner

    monkeypatch.setattr(runner, "GRACE_SECONDS", 0.01)
    caught: list[int] = []

    async def absorbs_one_cancel() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if caught:
                    raise
                caught.append(1)  # as a lost cancel does: the loop goes on

    stop = asyncio.Event()
    stop.set()
    await run_tasks({"watch": absorbs_one_cancel(), "other": asyncio.sleep(3600)}, stop)
    assert caught == [1]
