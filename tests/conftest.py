"""Fixtures every test group shares: a private nats-server per test, a connected Bus, a local
Tessera, an OTLP receiver, and the check that an async test leaks no asyncio tasks (tests/kit).

Each test that needs NATS gets its own server on a free port with a temporary store, so tests never
see each other's streams and a test may kill or restart its server freely.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.shared.natsserver import NatsServer

from kit.bus import bus, bus_service, bus_settings  # noqa: F401 - fixtures, registered by being here
from kit.clusters import PROFILES, start_cluster  # noqa: F401 - a fixture, registered by being here
from kit.kubecluster import (breakable_plane, kube_cluster, kube_namespace, kube_plane, kube_planes,  # noqa: F401
                             plane_namespace, spare_plane)  # (fixtures, registered by being here)
from kit.kubenode import kube_node, kube_session_node  # noqa: F401 - fixtures, registered by being here
from kit.postgres import postgres  # noqa: F401 - a fixture, registered by being here
from kit.leaks import _task_census, no_leaked_tasks, pytest_configure  # noqa: F401 - the leak check
from kit.processes import (  # noqa: F401 - SIGTERM interrupts a run as Ctrl-C does, even a stuck one
    pytest_fixture_post_finalizer,
    pytest_runtest_logreport,
    pytest_sessionstart,
)


# --- `make test-fast`: the edit-test loop -----------------------------------------------------

# Tests that use one of these start a server (or a whole Tessera, a browser, a container runtime):
# `pytest --fast` leaves them out. `make test` (and CI) runs everything.
SERVERS = {"nats_server", "nats_url", "bus", "bus_service", "platform_bus", "secured_nats", "start_cluster",
           "kube_cluster", "kube_namespace", "kube_plane", "plane_namespace", "breakable_plane", "postgres",
           "etcd_endpoint", "apiserver", "kube", "otlp_collector"}
SLOW_DIRS = ("containers", "ui", "reliability", "faults", "e2e", "metrics", "compose", "isolation", "gpu", "vgpu",
             "cli", "enforcer", "controlplane", "kubernetes", "capacity", "properties")
# Files elsewhere whose tests spawn processes of their own (the linters, the compiled core, nats-server).
SLOW_FILES = ("layering/test_make_lint.py", "placement/test_compiled_core.py", "placement/test_natsbench.py",
              "deploy/test_compose_nats_cluster.py", "kit/test_leak_check.py", "kit/test_interrupted_run.py",
              "shared/test_claim_pruning.py")


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="unit-level tests only: none that starts a server, a container or a browser")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--fast"):
        return
    here = Path(__file__).parent
    slow_roots = tuple(str(here / d) + "/" for d in SLOW_DIRS)
    slow_files = {str(here / f) for f in SLOW_FILES}
    keep, drop = [], []
    for item in items:
        path = str(item.path)
        slow = path.startswith(slow_roots) or path in slow_files or SERVERS & set(getattr(item, "fixturenames", ()))
        (drop if slow else keep).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


# --- an OTLP/HTTP trace receiver, speaking the real protocol ----------------------------------

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status


def _value(value: AnyValue):
    """An OTLP attribute value as Python: str, bool, int, float, or a list of them."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class OtlpCollector:
    """Receives what the services' OTLP exporters send to /v1/traces and keeps the spans."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.bodies: list[bytes] = []  # every request as received: a scan sees all a span carried
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with collector.lock:
                    collector.bodies.append(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector._add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _add(self, request) -> None:
        with self.lock:
            for rs in request.resource_spans:
                service = next(
                    (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), ""
                )
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append({
                            "service": service,
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            # "STATUS_CODE_UNSET" | "STATUS_CODE_OK" | "STATUS_CODE_ERROR"
                            "status": Status.StatusCode.Name(span.status.code),
                            "status_message": span.status.message,
                            "events": [{"name": e.name, "attributes": {a.key: _value(a.value) for a in e.attributes}}
                                       for e in span.events],
                        })

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def otlp_collector():
    with OtlpCollector() as collector:
        yield collector


# --- a whole local Tessera: nats-server + the five services as processes (kit.clusters) ------


@pytest.fixture
def profiles_dir() -> Path:
    return PROFILES
