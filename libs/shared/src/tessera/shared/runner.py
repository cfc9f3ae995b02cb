"""The service runner all five services share: named root tasks, probes, graceful stop.

A service is a small tree of named root tasks (consumer loops, heartbeats, the probe server). If any
root task ends, the others are cancelled with a short grace period and the error is re-raised: a
service never limps on with half its loops dead. SIGTERM or SIGINT cancels the tree, drains the NATS
connection and flushes the traces. /healthz answers while the process lives; /readyz answers 200
once every readiness gate the service declared has opened. Where ``TESSERA_METRICS_PORT`` is set,
/metrics is served on a listener of its own and its refreshes run as one more root task
(`tessera.shared.metrics`). Every log line names the trace and span it was written in
(`log_format`), so a line leads to its trace and a span to its lines.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Coroutine, Mapping, TypeVar

from aiohttp import web

from tessera.shared.bus import Bus
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.errors import ConfigError, TemporaryError
from tessera.shared.metrics import ServiceMetrics
from tessera.shared.settings import FromEnv, ServiceSettings, SettingsError, collect
from tessera.shared.telemetry import Telemetry, TraceIdsFilter

log = logging.getLogger("tessera.runner")

GRACE_SECONDS = 5.0


class RootTaskEnded(RuntimeError):
    """A root task returned or failed, so the service stops rather than run half-alive."""


@dataclass
class ServiceContext:
    settings: ServiceSettings
    bus: Bus
    telemetry: Telemetry
    gates: dict[str, bool] = field(default_factory=dict)
    extra_routes: list[web.RouteDef] = field(default_factory=list)
    metrics: ServiceMetrics = field(init=False)  # made from the settings

    def __post_init__(self) -> None:
        self.metrics = ServiceMetrics(self.settings.service, getattr(self.settings, "instance", ""))

    def gate(self, name: str) -> Callable[[], None]:
        """Declare a readiness gate; call the returned function when it opens."""
        self.gates[name] = False

        def open_gate() -> None:
            self.gates[name] = True

        return open_gate

    @property
    def ready(self) -> bool:
        return all(self.gates.values())


Build = Callable[[ServiceContext], Awaitable[Mapping[str, Coroutine]]]
S = TypeVar("S", bound=FromEnv)


async def _probe_server(ctx: ServiceContext) -> None:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "service": ctx.settings.service})

    async def readyz(_: web.Request) -> web.Response:
        connected = ctx.bus.connected
        ok = connected and ctx.ready
        body = {"ready": ok, "nats": connected, "gates": ctx.gates}
        return web.json_response(body, status=200 if ok else 503)

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz), *ctx.extra_routes])
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, ctx.settings.http_host, ctx.settings.http_port)
        await site.start()
        log.info("probes on http://%s:%d", ctx.settings.http_host, ctx.settings.http_port)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def is_ready(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """Whether the service whose probe server listens on ``port`` answers 200 on /readyz now
    (for whatever starts services and waits for them: `tessera up`, benchmarks, tests)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/readyz", timeout=timeout) as reply:
            return reply.status == 200
    except urllib.error.HTTPError as exc:  # 503: not ready (the error holds the open reply: close it)
        exc.close()
        return False
    except OSError:
        return False


def why_not_ready(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> str:
    """What /readyz says (NATS connected, each gate) for a service that is not ready, for the
    message of whoever gave up waiting on it."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/readyz", timeout=timeout) as reply:
            return reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:  # 503: the body names the gates
        with exc:
            return exc.read().decode(errors="replace")
    except OSError as exc:
        return f"no answer on /readyz ({exc})"


async def connect_with_retry(settings: ServiceSettings, telemetry: Telemetry, attempts: int = 60) -> Bus:
    for attempt in range(1, attempts + 1):
        try:
            return await Bus.connect(settings.bus, settings.service, telemetry)
        except TemporaryError as exc:
            if attempt == attempts:
                raise
            log.warning("%s (attempt %d/%d)", exc, attempt, attempts)
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


async def run_tasks(tasks: Mapping[str, Coroutine], stop: asyncio.Event) -> None:
    """Run named root tasks until one ends or ``stop`` is set; cancel the rest with a grace period."""
    running = {asyncio.create_task(coro, name=name): name for name, coro in tasks.items()}
    stopper = asyncio.create_task(stop.wait(), name="stop-signal")
    failure: BaseException | None = None
    try:
        done, _ = await asyncio.wait([*running, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is stopper:
                continue
            name = running[task]
            if task.cancelled():
                failure = RootTaskEnded(f"root task {name!r} was cancelled")
            elif task.exception() is not None:
                failure = task.exception()
                log.error("root task %r failed: %r", name, failure)
            else:
                failure = RootTaskEnded(f"root task {name!r} returned")
            break
    finally:
        stopper.cancel()
        # Cancelled again while they run on: one cancel can be lost (`tessera.shared.cancelling`).
        await cancel_and_wait(running, grace=GRACE_SECONDS, on_slow=lambda task: log.error(
            "root task %r ignored cancellation for %.0fs; cancelling it again", running[task], GRACE_SECONDS))
        await asyncio.gather(*running, return_exceptions=True)
    if failure is not None:
        raise failure


async def serve(settings: ServiceSettings, build: Build, *, stop: asyncio.Event | None = None) -> None:
    telemetry = Telemetry(settings.service, settings.otlp_endpoint, settings.instance)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    try:  # SIGUSR1 prints every task's stack: how to see what a stuck service is waiting for
        loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)
    except (NotImplementedError, RuntimeError):
        pass
    bus = await connect_with_retry(settings, telemetry)
    try:
        await bus.ensure_topology()
        ctx = ServiceContext(settings, bus, telemetry)
        tasks = dict(await build(ctx))
        if settings.http_port:
            tasks["probes"] = _probe_server(ctx)
        if settings.metrics_port:
            tasks["metrics"] = ctx.metrics.serve(settings.metrics_host, settings.metrics_port)
            tasks["metrics-refresh"] = ctx.metrics.poll(bus, settings.metrics_interval)
        log.info("%s started: %s", settings.service, ", ".join(tasks))
        await run_tasks(tasks, stop)
    finally:
        await bus.close()
        telemetry.shutdown()
        log.info("%s stopped", settings.service)


def _dump_tasks() -> None:
    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


def log_format(service: str) -> str:
    """Every service's log line: time, service, level, logger, the trace and span it was written
    in (``-`` outside any), message."""
    return f"%(asctime)s {service} %(levelname)s %(name)s trace=%(trace_id)s span=%(span_id)s: %(message)s"


def log_handler(service: str, stream=None) -> logging.Handler:
    """The handler every service logs through (to stderr unless ``stream``): `log_format`, with the
    filter that gives each record its trace and span ids."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(log_format(service)))
    handler.addFilter(TraceIdsFilter())
    return handler


def setup_logging(level: str, service: str) -> None:
    logging.basicConfig(level=getattr(logging, level, logging.INFO), handlers=[log_handler(service)])


ServiceBuild = Callable[[ServiceContext, S], Awaitable[Mapping[str, Coroutine]]]


def read_settings(service: str, settings_class: type[S],
                  env: Mapping[str, str] | None = None) -> tuple[ServiceSettings, S]:
    """The shared settings and the service's own, every variable checked: a `SettingsError` lists
    all that is wrong in both."""
    shared, problems = collect(ServiceSettings, env, service=service)
    own, more = collect(settings_class, env)
    if problems or more:
        raise SettingsError(problems + more)
    assert shared is not None and own is not None
    return shared, own


def main(service: str, settings_class: type[S], build: ServiceBuild[S], *,
         env: Mapping[str, str] | None = None) -> int:
    """The console-script entry of every service: read and check all its settings, run until
    SIGTERM, exit 0 on a clean stop.

    The settings (the shared ones and ``settings_class``, from ``env`` or the process environment)
    are read before anything connects: a bad one stops the service at once with exit code 2 and a
    message naming each bad variable. ``build(ctx, settings)`` then makes the root tasks.
    """
    try:
        shared, own = read_settings(service, settings_class, env)
    except ConfigError as exc:
        print(f"tessera-{service}: {exc}", file=sys.stderr)
        return 2
    setup_logging(shared.log_level, service)

    async def build_service(ctx: ServiceContext) -> Mapping[str, Coroutine]:
        return await build(ctx, own)

    try:
        asyncio.run(serve(shared, build_service))
    except KeyboardInterrupt:
        return 0
    except TemporaryError as exc:
        log.error("%s", exc)
        return 1
    except RootTaskEnded as exc:
        log.error("stopping: %s", exc)
        return 1
    except ConfigError as exc:
        log.error("configuration: %s", exc)
        return 2
    return 0
