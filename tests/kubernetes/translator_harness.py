"""The real translator service, run in this test's event loop against a real nats-server (and, in
Kubernetes mode, against the API-server emulator), stopped as SIGTERM would stop it."""

from __future__ import annotations

import asyncio
import contextlib

from tessera.shared.natsserver import free_port  # noqa: F401 - the port helper the tests use
from tessera.shared.runner import serve
from tessera.shared.settings import BusSettings, ServiceSettings
from tessera.translator.service import TranslatorService, TranslatorSettings


@contextlib.asynccontextmanager
async def running_translator(nats_url: str, settings: TranslatorSettings, kube_api=None):
    """Yields the TranslatorService once it has started (its webhook port accepting, if any)."""
    started: list[TranslatorService] = []

    async def build(ctx):
        service = TranslatorService(ctx, settings, kube_api)
        started.append(service)
        return await service.start()

    stop = asyncio.Event()
    task = asyncio.create_task(serve(ServiceSettings(service="translator", bus=BusSettings(url=nats_url)),
                                     build, stop=stop))
    try:
        async with asyncio.timeout(60):
            while not started or (settings.webhook_port and not await _accepts(settings.webhook_port)):
                if task.done():
                    task.result()
                await asyncio.sleep(0.05)
        yield started[0]
    finally:
        stop.set()
        await task


async def _accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True
