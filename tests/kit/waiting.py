"""Waiting for something to happen: poll what the test can observe until it holds.

A test that sleeps a fixed time either waits too long or, on a loaded machine, not long enough;
`eventually` waits as long as it takes and no longer, and on timeout says what it last saw.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Awaitable, Callable

_NOTHING = object()


async def eventually(check: Callable[[], Any | Awaitable[Any]], timeout: float = 60.0, every: float = 0.1,
                     what: str | None = None) -> Any:
    """Call ``check()`` (plain or async) every ``every`` seconds until it returns something truthy,
    and return that. An exception from ``check`` counts as "not yet" (a key not written yet, an
    assert not true yet). After ``timeout`` seconds: AssertionError naming ``what`` (or the check)
    with the last value it returned, or the last exception it raised as the cause."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = _NOTHING
    error: BaseException | None = None
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:  # noqa: BLE001 - shown on timeout, see the docstring
            error, last = exc, _NOTHING
        else:
            if value:
                return value
            error, last = None, value
        if loop.time() >= deadline:
            name = what or getattr(check, "__qualname__", repr(check))
            if error is not None:
                raise AssertionError(f"{name}: not true after {timeout:g}s; it last raised {error!r}") from error
            raise AssertionError(f"{name}: not true after {timeout:g}s; it last returned {last!r}")
        await asyncio.sleep(every)
