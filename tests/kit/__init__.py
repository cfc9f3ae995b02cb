"""The tests' kit: the helpers every test directory shares, written once.

- `kit.waiting.eventually`: wait for observable state instead of sleeping a fixed time.
- `kit.clusters`: one way to start a whole local Tessera (`start_local`, the `start_cluster` factory).
- `kit.bus`: a connected `Bus` on the test's own nats-server (`bus`, shaped by `bus_settings`).
- `kit.leaks`: an async test that leaves asyncio tasks running fails (`no_leaked_tasks`).

tests/conftest.py registers the fixtures; tests import the functions from here.
"""

from kit.bus import open_bus
from kit.clusters import PROFILES, start_local
from kit.waiting import eventually

__all__ = ["PROFILES", "eventually", "open_bus", "start_local"]
