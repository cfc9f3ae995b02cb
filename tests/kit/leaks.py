"""An async test that leaves asyncio tasks running fails.

A task still running when a test and its fixtures are done is a loop nobody stops: in a service it
is a consumer that outlives its shutdown, in a test it keeps a connection or a subscription alive
and lets the next test see it. `no_leaked_tasks` (autouse, registered in tests/conftest.py) notes
the tasks alive when an async test starts; after the test *and its fixtures' teardown* it waits a
moment (``GRACE_SECONDS``: a task cancelled in a teardown needs a loop turn or two to end) and then
fails the test, at teardown, naming every task that was not there before and is still running:
its name, its coroutine and the line it waits on.

Stop tasks with `tessera.shared.cancelling.cancel_and_wait` (a single ``task.cancel()`` is not
always enough on Python 3.11, see that module). Where a task truly must outlive a test (a library's
own background task that its close does not wait for), mark the test
``@pytest.mark.leaves_tasks("task-name-pattern", reason="why it outlives the test")``; patterns
are `fnmatch` patterns over task names. Sync tests run no loop of their own and are not checked;
the check looks at the function-scoped loop every async test runs in here (pyproject's
``asyncio_default_test_loop_scope``): a test moved to a wider loop scope would need its own census.
"""

from __future__ import annotations

import asyncio
import fnmatch
import inspect

import pytest

GRACE_SECONDS = 1.0
MARKER = "leaves_tasks"


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(*patterns, reason): tasks (fnmatch over task names) this test may leave "
                   "running; tests/kit/leaks.py says when that is acceptable")


def describe(task: asyncio.Task) -> str:
    """``name: coroutine at file:line`` of a task: its own coroutine and the line of it that waits
    now (the code that made the task, rather than the library call it waits in)."""
    coro = task.get_coro()
    name = getattr(coro, "__qualname__", repr(coro))
    frame = getattr(coro, "cr_frame", None)
    where = f" at {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
    return f"{task.get_name()}: {name}{where}"


def _allowed(request) -> list[str]:
    patterns: list[str] = []
    for mark in request.node.iter_markers(MARKER):
        if not mark.kwargs.get("reason"):
            raise pytest.UsageError(f"{request.node.nodeid}: @pytest.mark.{MARKER} needs reason='why the "
                                    "task outlives the test'")
        patterns.extend(mark.args)
    return patterns


def _is_async(request) -> bool:
    return request.node.get_closest_marker("asyncio") is not None or inspect.iscoroutinefunction(
        getattr(request.node, "obj", None))


@pytest.fixture(autouse=True)
def no_leaked_tasks(request):
    """See the module docstring; async tests get the check, sync tests nothing."""
    if _is_async(request):
        request.getfixturevalue("_task_census")
    yield


@pytest.fixture
async def _task_census(request):
    allowed = _allowed(request)
    before = asyncio.all_tasks()
    yield
    me = asyncio.current_task()
    new = [t for t in asyncio.all_tasks() - before if t is not me and not t.done()
           and not any(fnmatch.fnmatchcase(t.get_name(), p) for p in allowed)]
    if new:
        await asyncio.wait(new, timeout=GRACE_SECONDS)
    leaked = [t for t in new if not t.done()]
    if leaked:
        listing = "\n  ".join(describe(t) for t in leaked)
        for task in leaked:  # once, bounded: the report matters here, not a task that resists
            task.cancel()
        await asyncio.wait(leaked, timeout=GRACE_SECONDS)
        pytest.fail(f"the test left {len(leaked)} asyncio task(s) running after its teardown "
                    f"(stop them with tessera.shared.cancelling.cancel_and_wait):\n  {listing}", pytrace=False)
