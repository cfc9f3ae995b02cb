"""The service runner: named root tasks live and die together; SIGTERM stops cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tessera.shared.natsserver import free_port
from tessera.shared.runner import RootTaskEnded, is_ready, run_tasks


async def test_a_failing_root_task_cancels_the_others_and_reraises():
    cancelled = asyncio.Event()

    async def loop_forever():
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    async def fail_soon():
        await asyncio.sleep(0.05)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await run_tasks({"loop": loop_forever(), "fail": fail_soon()}, asyncio.Event())
    assert cancelled.is_set()


async def test_a_root_task_that_returns_stops_the_service():
    async def done():
        return None

    async def loop_forever():
        await asyncio.Event().wait()

    with pytest.raises(RootTaskEnded, match="'done' returned"):
        await run_tasks({"done": done(), "loop": loop_forever()}, asyncio.Event())


async def test_stop_event_ends_everything_without_error():
    stop = asyncio.Event()

    async def loop_forever():
        await asyncio.Event().wait()

    asyncio.get_running_loop().call_later(0.05, stop.set)
    await run_tasks({"a": loop_forever(), "b": loop_forever()}, stop)


def test_sigterm_drains_and_exits_zero_with_probes_up_until_then(nats_url, tmp_path):
    port = free_port()
    env = dict(os.environ, TESSERA_NATS_URL=nats_url, TESSERA_HTTP_PORT=str(port))
    proc = subprocess.Popen([str(Path(sys.executable).parent / "tessera-translator")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not is_ready(port):
            assert time.monotonic() < deadline, "translator never became ready"
            time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()

