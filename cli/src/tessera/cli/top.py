"""`tessera top` and `tessera ui`: the live fleet, in the terminal or in a browser.

Both keep a `FleetModel` current with `tessera.cli.feed` (watches, not polling) under the read-only
viewer identity by default, and draw its snapshot: `top` as the same tables `tessera status` prints,
redrawn on each change; `ui` as the page of `tessera.cli.webui`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from rich.console import Console, Group
from rich.live import Live

from tessera.cli import exitcodes, feed, views, webui
from tessera.cli.client import Client
from tessera.cli.errors import CliError
from tessera.cli.fleetmodel import FleetModel
from tessera.cli.options import client_command

console = Console()
err = Console(stderr=True)


def register(sub: argparse._SubParsersAction) -> None:
    tp = client_command(sub, "top", "the live fleet in the terminal, redrawn on every change")
    tp.add_argument("--screen", action="store_true", help="use the whole terminal (alternate screen)")
    tp.set_defaults(func=cmd_top)
    ui = client_command(sub, "ui", "serve the live fleet view (a web page) until Ctrl-C")
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ui.add_argument("--port", type=int, default=8470, help="port (default 8470; 0: any free one)")
    ui.set_defaults(func=cmd_ui)


@contextlib.asynccontextmanager
async def live_model(client: Client):
    """A model kept current while the block runs; the block sees it loaded."""
    model = FleetModel()
    ready = asyncio.Event()
    task = asyncio.create_task(feed.follow(client.bus, model, ready), name="fleet-feed")
    waiter = asyncio.create_task(ready.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        waiter.cancel()
        exc = task.exception()
        raise CliError(f"cannot follow the fleet: {exc}", code=exitcodes.UNAVAILABLE)
    try:
        yield model, task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _until(stop: asyncio.Event, feed_task: asyncio.Task, seconds: float | None = None) -> None:
    waiters = [asyncio.create_task(stop.wait()), feed_task]
    done, _ = await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    waiters[0].cancel()
    if feed_task in done and not feed_task.cancelled() and feed_task.exception():
        raise CliError(f"lost the fleet's watch: {feed_task.exception()}", code=exitcodes.UNAVAILABLE)


def render(model: FleetModel):
    snap = model.snapshot()
    return Group(views.fleet_table(snap), views.snapshot_summary(snap), views.tenants_table(snap),
                 "[dim]live: redrawn on every change; Ctrl-C quits[/]")


async def cmd_top(args) -> int:
    client = await Client.from_args(args, read_only=True)
    stop = _stop_event()
    try:
        async with live_model(client) as (model, task):
            with Live(render(model), console=console, refresh_per_second=4, screen=args.screen) as live:
                seen = model.version
                stopper = asyncio.create_task(stop.wait())
                try:
                    while not stop.is_set():
                        waiter = asyncio.create_task(model.changed(seen, timeout=5))
                        done, _ = await asyncio.wait({waiter, stopper, task}, return_when=asyncio.FIRST_COMPLETED)
                        if task in done:
                            waiter.cancel()
                            problem = None if task.cancelled() else task.exception()
                            raise CliError(f"lost the fleet's watch: {problem!r}", code=exitcodes.UNAVAILABLE)
                        if waiter in done:
                            seen = waiter.result()
                            live.update(render(model))
                            await asyncio.sleep(0.25)  # at most four redraws a second
                        else:
                            waiter.cancel()
                    live.update(render(model))  # the frame left on the screen is the fleet as it is now
                finally:
                    stopper.cancel()
    finally:
        await client.close()
    return exitcodes.OK


async def cmd_ui(args) -> int:
    client = await Client.from_args(args, read_only=True)
    stop = _stop_event()
    try:
        async with live_model(client) as (model, task):
            async with webui.serving(model, args.host, args.port) as url:
                console.print(f"fleet view at {url}  (Ctrl-C stops)")
                console.file.flush()  # (a script reading our stdout through a pipe sees the URL now)
                await _until(stop, task)
    finally:
        await client.close()
    return exitcodes.OK
