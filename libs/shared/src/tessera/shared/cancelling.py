"""Stopping tasks for sure: cancel, and cancel again a task that lived through it.

One ``task.cancel()`` does not always stop a task on Python 3.11: ``asyncio.wait_for`` returns its
future's result instead of raising ``CancelledError`` when that future finished in the same loop
iteration as the cancel (python/cpython#86296, fixed in 3.12 where ``wait_for`` is built on
``asyncio.timeout``). nats-py awaits every reply that way (each KV read and write, each publish
ack), so a root task cancelled while a reply is arriving goes on running, and a task that loops
forever (a consumer, a watch) then never ends: whoever awaits it after its one cancel waits
forever. `cancel_and_wait` is the one way tasks are stopped: a task still running ``grace`` seconds
after its cancel is cancelled again (and again, each ``grace``), until every one has ended. The
grace is what a task's own clean-up (a ``finally`` that drains a connection) may take before it is
interrupted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable, TypeVar

log = logging.getLogger("tessera.cancelling")

GRACE_SECONDS = 1.0

_F = TypeVar("_F", bound=asyncio.Future)


async def cancel_and_wait(tasks: Iterable[_F], *, grace: float = GRACE_SECONDS,
                          on_slow: Callable[[_F], None] | None = None) -> None:
    """Cancel ``tasks`` and return once every one has ended (their outcomes are left on them).
    Each task still running ``grace`` seconds after a cancel is handed to ``on_slow`` (to be
    logged) and cancelled again."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=grace)
        for task in pending:
            (on_slow or _log_slow)(task)


def _log_slow(task: asyncio.Future) -> None:
    name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
    log.warning("task %s is still running after its cancellation; cancelling it again", name)
