"""Every service's Prometheus endpoint: one registry per process, one listener, the bus's own series.

The series name tenants and claims (quota use, HAMi's per-claim series), while the probe port must
stay open to the kubelet and so to anything on the pod network. So /metrics has a listener of its
own (``TESSERA_METRICS_HOST``/``TESSERA_METRICS_PORT``, 9394 in deploy/), never the probe port, and
deploy/k8s admits only the monitoring namespace to it. The runner serves it for every service; a
service adds its own collectors to `ServiceMetrics.registry` and its own refreshes to `every`.

What it costs the hot path: at most a counter increment or a histogram observation per event.
Gauges over a service's own state are read when scraped; values that need a round trip to the
server (consumer lag, dead letters) or real arithmetic (fragmentation) are refreshed by one task
every ``TESSERA_METRICS_INTERVAL`` seconds, off the path, and scrapes render the last refresh.
docs/metrics.md lists every series.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Iterable, Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

log = logging.getLogger("tessera.metrics")

# HAMi puts every series of its scheduler and monitor in zone "vGPU"; dashboards select on it.
ZONE = "vGPU"
MIB = 1 << 20
# Seconds: from a fraction of a millisecond (one decision in memory) to a claim that waited.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0)

Refresh = Callable[[], Awaitable[None]]


def _escape(value: str) -> str:
    if not ('"' in value or "\\" in value or "\n" in value):  # (names and ids are tokens: the usual case)
        return value
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def labelset(labels: Sequence[str], values: Sequence[str]) -> str:
    """The inside of a sample's braces, escaped once, for the several samples that share it."""
    return ",".join(f'{k}="{_escape(v)}"' for k, v in zip(labels, values))


def line(name: str, labels: str, value: float) -> str:
    """One sample in Prometheus' text format (``labels`` from `labelset`)."""
    if isinstance(value, int):
        text = str(value)
    elif value == value and value not in (float("inf"), float("-inf")):
        text = repr(value)
    else:
        text = floatToGoString(value)
    return f"{name}{{{labels}}} {text}\n"


class Exposition:
    """Gauge families a service writes as Prometheus text itself, in parts (one per node) that are
    rebuilt only when that part changed. For series too many to build as objects on every scrape:
    prometheus-client pays for each sample, and placement's per-GPU HAMi series at a thousand nodes
    of eight GPUs are over a hundred thousand samples, too long a stall of a loop that decides claims."""

    def __init__(self, families: Iterable[tuple[str, str]]) -> None:
        self.families = dict(families)  # name -> help
        self.parts: dict[str, dict[str, bytes]] = {}  # part -> family -> its lines, encoded

    def set(self, part: str, lines: dict[str, list[str]]) -> None:
        self.parts[part] = {name: "".join(ls).encode() for name, ls in lines.items() if ls}

    def keep_only(self, parts: Iterable[str]) -> None:
        keep = set(parts)
        for part in [p for p in self.parts if p not in keep]:
            del self.parts[part]

    def render(self) -> bytes:
        out = []
        ordered = sorted(self.parts.items())
        for name, doc in self.families.items():
            out.append(f"# HELP {name} {doc.replace(chr(92), chr(92) * 2)}\n# TYPE {name} gauge\n".encode())
            out.extend(lines[name] for _, lines in ordered if name in lines)
        return b"".join(out)


class BusLag:
    """Consumer lag and dead letters of one service, as last read from the server."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.consumers: dict[tuple[str, str], tuple[int, int, int]] = {}
        self.dead_letters: int | None = None
        self.connected = False
        self.refreshed = 0.0

    async def refresh(self, bus) -> None:
        self.connected = bus.connected
        if not self.connected:
            return
        self.consumers = dict(await bus.consumer_lag())
        self.dead_letters = await bus.dead_letters(self.service)
        self.refreshed = time.time()

    def collect(self):
        labels = ["stream", "consumer"]
        pending = GaugeMetricFamily("tessera_consumer_pending_messages",
                                    "messages of the stream this durable consumer has not yet been given "
                                    "(its lag; JetStream num_pending)", labels=labels)
        acking = GaugeMetricFamily("tessera_consumer_ack_pending_messages",
                                   "messages given to the consumer and not yet acknowledged", labels=labels)
        redelivered = GaugeMetricFamily("tessera_consumer_redelivered_messages",
                                        "messages being delivered again (a handler failed or timed out)",
                                        labels=labels)
        for (stream, durable), (n, ack, again) in sorted(self.consumers.items()):
            pending.add_metric([stream, durable], n)
            acking.add_metric([stream, durable], ack)
            redelivered.add_metric([stream, durable], again)
        yield from (pending, acking, redelivered)
        if self.dead_letters is not None:
            dlq = GaugeMetricFamily("tessera_dlq_messages",
                                    "dead letters of this service kept in TESSERA_DLQ (tessera.dlq.<service>)",
                                    labels=["service"])
            dlq.add_metric([self.service], self.dead_letters)
            yield dlq
        up = GaugeMetricFamily("tessera_nats_connected", "1 while the service's NATS connection is up")
        up.add_metric([], 1 if self.connected else 0)
        yield up
        if self.refreshed:
            fresh = GaugeMetricFamily("tessera_metrics_refreshed_timestamp_seconds",
                                      "when the lag, dead letters and computed gauges were last refreshed")
            fresh.add_metric([], self.refreshed)
            yield fresh


class ServiceMetrics:
    """The registry a service's collectors join, and the refreshes run off its hot path."""

    def __init__(self, service: str, instance: str = "") -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        self.lag = BusLag(service)
        self.registry.register(self.lag)
        info = Gauge("tessera_service_info", "1 for each running Tessera service process",
                     ["service", "instance"], registry=self.registry)
        info.labels(service, instance).set(1)
        self._refreshes: list[Refresh] = []
        self._texts: list[Exposition] = []

    # --- what services use -------------------------------------------------------------------

    def add(self, collector) -> None:
        """A collector whose ``collect()`` yields metric families from the service's own state."""
        self.registry.register(collector)

    def text(self, exposition: Exposition) -> None:
        """Families the service renders itself (`Exposition`), served after the registry's."""
        self._texts.append(exposition)

    def every(self, refresh: Refresh) -> None:
        """Run ``refresh`` with every poll (for values too costly to compute when scraped)."""
        self._refreshes.append(refresh)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, list(labels), registry=self.registry)

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Iterable[float] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, doc, list(labels), buckets=tuple(buckets), registry=self.registry)

    # --- what the runner runs ----------------------------------------------------------------

    async def refresh(self, bus) -> None:
        try:
            await self.lag.refresh(bus)
        except Exception as exc:  # the server away or slow: the last values stay, the next poll retries
            log.debug("consumer lag not refreshed: %r", exc)
        for refresh in self._refreshes:
            try:
                await refresh()
            except Exception:
                log.exception("a metrics refresh failed; its gauges keep their last values")

    async def poll(self, bus, interval: float) -> None:
        """Forever: refresh, then wait ``interval`` seconds."""
        while True:
            await self.refresh(bus)
            await asyncio.sleep(interval)

    def render(self) -> bytes:
        return generate_latest(self.registry) + b"".join(t.render() for t in self._texts)

    async def serve(self, host: str, port: int) -> None:
        """Forever: ``/metrics`` (and nothing else) on its own listener."""
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=self.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.add_routes([web.get("/metrics", metrics)])
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            log.info("metrics on http://%s:%d/metrics", host, port)
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
