"""The manager's periodic resync outlives a NATS outage: a KV read refused while a cluster elects a
new leader (`TemporaryError`) is retried, not the end of the process (the three-member cluster test
saw the manager stop on 'cannot read the KV bucket tenants now')."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tessera.controlplane.app import Manager
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.errors import TemporaryError


class FlakyReconciler:
    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.passes = 0

    async def resync(self) -> None:
        self.passes += 1
        if self.passes <= self.refusals:
            raise TemporaryError("cannot read the KV bucket tenants now: ServiceUnavailableError()", delay=0.01)


class Host:
    async def close(self) -> None:
        pass


async def test_a_refused_resync_is_tried_again():
    reconciler = FlakyReconciler(refusals=2)
    manager = Manager(store=None, reconciler=reconciler, api=None, drivers={}, host=Host(),
                      settings=SimpleNamespace(resync_seconds=0.05), resources=None)
    ready = asyncio.Event()
    task = asyncio.create_task(manager.resync_forever(ready.set))
    try:
        await asyncio.wait_for(ready.wait(), 10)  # the first pass that went through made it ready
        assert reconciler.passes == 3 and not task.done()  # (and the process goes on)
    finally:
        await cancel_and_wait([task])
