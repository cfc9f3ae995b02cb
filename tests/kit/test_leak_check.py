"""The leak check fails an async test that leaves a task running, and only that test.

A planted test file runs in a pytest of its own (a subprocess, with the kit's fixtures registered
as tests/conftest.py registers them): a clean test passes, a leaking one errors at teardown (failing
the run) naming its task, a test that stops its task with `cancel_and_wait` passes, and a test marked
``leaves_tasks`` with a reason is let through.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

KIT_PARENT = Path(__file__).resolve().parents[1]

PLANTED = '''
import asyncio
import pytest
from tessera.shared.cancelling import cancel_and_wait


async def test_clean():
    await asyncio.sleep(0)


async def watch_forever():
    await asyncio.Event().wait()


async def test_leaks_a_task():
    asyncio.create_task(watch_forever(), name="forgotten-watch")


async def test_stops_its_task():
    task = asyncio.create_task(asyncio.Event().wait(), name="stopped-watch")
    await asyncio.sleep(0)
    await cancel_and_wait([task])


@pytest.fixture
async def watcher():
    task = asyncio.create_task(asyncio.Event().wait(), name="fixture-watch")
    yield task
    await cancel_and_wait([task])


async def test_a_fixture_that_stops_its_task_in_teardown(watcher):
    assert not watcher.done()


@pytest.mark.leaves_tasks("library-*", reason="the library's close does not wait for it")
async def test_allowed_to_leave_one():
    asyncio.create_task(asyncio.Event().wait(), name="library-flusher")


def test_sync_tests_are_not_checked():
    pass
'''


def test_a_test_that_leaks_a_task_fails_naming_it(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {str(KIT_PARENT)!r})
        from kit.leaks import _task_census, no_leaked_tasks, pytest_configure  # noqa: F401
    '''))
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
                                         "filterwarnings = error\naddopts = --strict-markers\n")
    (tmp_path / "test_planted.py").write_text(PLANTED)
    # (the outer run's PYTEST_ADDOPTS, a --basetemp above tmp_path for one, is not the planted run's)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    # The leaking test itself passed; its teardown is the error that fails the run.
    assert "6 passed, 1 error" in out, out
    assert "ERROR test_planted.py::test_leaks_a_task" in out, out
    assert "forgotten-watch: watch_forever at " in out and "test_planted.py:" in out, out
    for name in ("stopped-watch", "fixture-watch", "library-flusher"):
        assert f"{name}:" not in out, out
