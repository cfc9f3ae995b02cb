"""The fleet view's server-sent event streams end with the server: an open browser tab must not keep
a handler waiting (for up to the keep-alive period) after `webui.serving` has returned."""

from __future__ import annotations

import asyncio

import aiohttp

from tessera.cli import webui
from tessera.cli.fleetmodel import FleetModel


async def test_an_open_event_stream_returns_when_the_view_stops():
    model = FleetModel()
    async with aiohttp.ClientSession() as http:
        async with webui.serving(model) as url:
            response = await http.get(url + "api/events")
            assert (await response.content.readline()).startswith(b"event: fleet")
            handlers = [t for t in asyncio.all_tasks() if "_handle_request" in repr(t.get_coro())]
            assert handlers, "the stream's handler is running"
        # serving has returned: the stream's handler has returned with it, not been left waiting
        assert all(t.done() for t in handlers), handlers
        response.close()
