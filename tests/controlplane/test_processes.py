"""The manager's own long-lived processes: stopped all together, and for sure.

`make bench` found this: the service's shutdown cancels its clean-up after a grace of its own, and
a clean-up that stopped the tenants' processes one by one was cut off half-way, leaving API servers
running with their directory gone."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tessera.controlplane import processes


def _stubborn(tmp_path: Path, n: int) -> list[tuple[int, str]]:
    """Processes that ignore SIGTERM (as a busy API server may, for its shutdown delay)."""
    owned = []
    for i in range(n):
        owner = f"{tmp_path}:stubborn-{i}"
        pid = processes.spawn(["/bin/sh", "-c", "trap '' TERM; while :; do sleep 1; done"],
                              tmp_path / f"{i}.log", owner)
        owned.append((pid, owner))
    return owned


async def test_stopping_together_kills_what_is_left_even_when_cancelled(tmp_path):
    owned = _stubborn(tmp_path, 3)
    await asyncio.sleep(0.3)  # (their shells have set the trap)
    assert all(processes.running(pid, owner) for pid, owner in owned)
    stopping = asyncio.create_task(processes.stop_together(owned, grace=30))
    await asyncio.sleep(0.5)
    stopping.cancel()  # the service's own grace ran out
    await asyncio.gather(stopping, return_exceptions=True)
    for _ in range(100):
        if not any(processes.running(pid, owner) for pid, owner in owned):
            break
        await asyncio.sleep(0.05)
    assert [pid for pid, owner in owned if processes.running(pid, owner)] == []




def test_cpu_seconds_counts_a_busy_process_and_none_once_it_is_gone():
    import subprocess
    import sys

    spin = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\ntime.sleep(60)"
    with subprocess.Popen([sys.executable, "-c", spin]) as busy:
        try:
            while processes.cpu_seconds(busy.pid) < 0.4:  # (the pytest timeout bounds it)
                pass
        finally:
            busy.kill()
    assert processes.cpu_seconds(busy.pid) == 0.0
