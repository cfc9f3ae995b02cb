"""`tessera ui`: the live fleet view in a browser, served by aiohttp.

The server is a client of the public buckets and the usage stream like the rest of the CLI (by
default as the read-only `viewer`): `tessera.cli.feed` keeps a `FleetModel` current by watching, and
the page gets the model's snapshot (the document `tessera status -o json` prints) once from
``/api/fleet`` and then from server-sent events on ``/api/events`` each time it changes (at most
`MAX_RATE` a second). The page (static/fleet.html) is self-contained: no CDN, no fonts to fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from importlib import resources

from aiohttp import web

from tessera.cli.fleetmodel import FleetModel

log = logging.getLogger("tessera.cli.webui")

MAX_RATE = 4.0  # snapshots per second per browser, at most
KEEPALIVE_SECONDS = 15.0
WAKE_SECONDS = 0.5  # how soon an open event stream sees the server closing
MODEL_KEY = web.AppKey("model", FleetModel)
CLOSING_KEY = web.AppKey("closing", asyncio.Event)


def page() -> bytes:
    return resources.files("tessera.cli").joinpath("static/fleet.html").read_bytes()


async def _index(request: web.Request) -> web.Response:
    return web.Response(body=page(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store"})


async def _fleet(request: web.Request) -> web.Response:
    return web.json_response(request.app[MODEL_KEY].snapshot())


async def _events(request: web.Request) -> web.StreamResponse:
    model = request.app[MODEL_KEY]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    closing = request.app[CLOSING_KEY]
    seen = -1
    loop = asyncio.get_running_loop()
    written = loop.time()
    try:
        # A stream ends when the browser goes or the server closes (`_close_streams`): left to
        # aiohttp's shutdown, it was cancelled mid-wait after its timeout, and outlived the server.
        while not closing.is_set():
            if model.version != seen:
                seen = model.version
                data = json.dumps(model.snapshot(), separators=(",", ":"))
                await response.write(f"event: fleet\nid: {seen}\ndata: {data}\n\n".encode())
                written = loop.time()
                await asyncio.sleep(1 / MAX_RATE)
                continue
            await model.changed(seen, timeout=WAKE_SECONDS)
            if model.version == seen and loop.time() - written >= KEEPALIVE_SECONDS:
                await response.write(b": keep-alive\n\n")
                written = loop.time()
    except ConnectionResetError:  # the browser went
        pass
    return response


async def _close_streams(application: web.Application) -> None:
    """At shutdown (before aiohttp waits for handlers): every open event stream returns."""
    application[CLOSING_KEY].set()


def app(model: FleetModel) -> web.Application:
    application = web.Application()
    application[MODEL_KEY] = model
    application[CLOSING_KEY] = asyncio.Event()
    application.on_shutdown.append(_close_streams)
    application.router.add_get("/", _index)
    application.router.add_get("/api/fleet", _fleet)
    application.router.add_get("/api/events", _events)
    return application


@contextlib.asynccontextmanager
async def serving(model: FleetModel, host: str = "127.0.0.1", port: int = 0):
    """Serve the view while the block runs; yields its URL (port 0: a free one)."""
    runner = web.AppRunner(app(model), handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # (aiohttp has no public accessor for port 0's choice)
    try:
        yield f"http://{host}:{bound}/"
    finally:
        await runner.cleanup()
