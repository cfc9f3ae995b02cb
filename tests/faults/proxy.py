"""A TCP proxy between one service and nats-server that drops, delays or cuts traffic on command.

The fault suite needs faults a real network makes and a test cannot otherwise make on demand: a
KV write that reaches the server and commits while its reply never comes back (the caller sees a
timeout with an unknown outcome), a slow link, a connection cut mid-stream. The proxy forwards
bytes unchanged in both directions and applies, per direction, one of: pass, delay (hold each
chunk for a while), drop (read and discard: the peer waits forever, like a lost packet stream),
or cut (close every connection now). NATS is a line protocol over TCP, so dropping
server→client bytes after a client's PUB loses exactly the reply (and the PINGs) of what was
already sent; the client then times out and reconnects, the server keeps what it committed.

It runs on its own event loop in a thread, so synchronous test code and an asyncio test can both
drive it.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from tessera.shared.cancelling import cancel_and_wait

UPSTREAM = "to_server"  # client → nats-server
DOWNSTREAM = "to_client"  # nats-server → client


@dataclass
class Direction:
    """What happens to bytes flowing one way: ``mode`` is pass | delay | drop."""

    mode: str = "pass"
    delay_seconds: float = 0.0
    bytes_seen: int = 0
    bytes_dropped: int = 0


@dataclass
class _Link:
    client_writer: asyncio.StreamWriter
    server_writer: asyncio.StreamWriter
    tasks: list[asyncio.Task] = field(default_factory=list)


class FaultProxy:
    """``FaultProxy(upstream_port).start()``; clients connect to ``url``; ``drop(DOWNSTREAM)`` etc."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.port = 0
        self.directions = {UPSTREAM: Direction(), DOWNSTREAM: Direction()}
        self.connections_accepted = 0
        # drop_replies_after: bytes that, seen going to the server, start dropping what comes back
        self._trigger: bytes | None = None
        self._trigger_drops_request = False  # drop_from: the chunk with the marker is dropped too
        self.triggered = threading.Event()
        self._links: list[_Link] = []
        self._pumps: set[asyncio.Task] = set()  # every pump, also of links already closed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # --- life cycle ---------------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start listening within 10 s")
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._listen())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._shutdown())
        self._loop.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def url_with_credentials(self, url: str) -> str:
        """``url`` (which may carry user:password@) pointed at the proxy instead of the server."""
        scheme, _, rest = url.partition("://")
        creds, at, _ = rest.rpartition("@")
        return f"{scheme}://{creds}{at}127.0.0.1:{self.port}"

    # --- commands (thread-safe) ---------------------------------------------------------------
    def passthrough(self, direction: str | None = None) -> None:
        self._trigger = None
        for name in self._names(direction):
            self.directions[name].mode = "pass"
            self.directions[name].delay_seconds = 0.0

    def delay(self, direction: str, seconds: float) -> None:
        d = self.directions[direction]
        d.delay_seconds = seconds
        d.mode = "delay"

    def drop(self, direction: str) -> None:
        self.directions[direction].mode = "drop"

    def drop_replies_after(self, marker: bytes) -> None:
        """Pass everything until a chunk to the server contains ``marker`` (for example
        ``b"$KV.ledger.node."``, a ledger write): that chunk still reaches the server, and from then
        on nothing comes back. ``triggered`` is set at that moment."""
        self.triggered.clear()
        self._trigger_drops_request = False
        self._trigger = marker

    def drop_from(self, marker: bytes) -> None:
        """Pass everything until a chunk to the server contains ``marker``: that chunk and all
        after it are dropped both ways (the request never arrives, nothing comes back).
        ``triggered`` is set at that moment."""
        self.triggered.clear()
        self._trigger_drops_request = True
        self._trigger = marker

    def cut(self) -> None:
        """Close every open connection now (both ends see a reset); new connections still pass."""
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(10)

    def _names(self, direction: str | None) -> list[str]:
        return [direction] if direction else [UPSTREAM, DOWNSTREAM]

    # --- forwarding ---------------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections_accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:  # the server is down (a scenario killed it): the client retries
            writer.close()
            await writer.wait_closed()
            return
        link = _Link(writer, up_writer)
        link.tasks = [
            asyncio.create_task(self._pump(reader, up_writer, self.directions[UPSTREAM], link)),
            asyncio.create_task(self._pump(up_reader, writer, self.directions[DOWNSTREAM], link)),
        ]
        self._links.append(link)
        for task in link.tasks:
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    direction: Direction, link: _Link) -> None:
        try:
            while chunk := await reader.read(65536):
                direction.bytes_seen += len(chunk)
                if self._trigger is not None and direction is self.directions[UPSTREAM] and self._trigger in chunk:
                    self._trigger = None
                    self.directions[DOWNSTREAM].mode = "drop"
                    if self._trigger_drops_request:
                        direction.mode = "drop"
                    self.triggered.set()
                if direction.mode == "drop":
                    direction.bytes_dropped += len(chunk)
                    continue
                if direction.mode == "delay" and direction.delay_seconds > 0:
                    await asyncio.sleep(direction.delay_seconds)
                writer.write(chunk)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._close_link(link)

    def _close_link(self, link: _Link) -> None:
        for w in (link.client_writer, link.server_writer):
            if not w.is_closing():
                w.close()
        if link in self._links:
            self._links.remove(link)

    async def _close_all(self) -> None:
        links = list(self._links)
        for link in links:
            self._close_link(link)
        await cancel_and_wait([task for link in links for task in link.tasks])
        for link in links:
            for w in (link.client_writer, link.server_writer):
                try:
                    await w.wait_closed()
                except OSError:
                    pass

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self._close_all()
        pumps = list(self._pumps)
        await cancel_and_wait(pumps)
