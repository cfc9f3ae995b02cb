"""A stand-in for Jaeger in the local compose run (compose.local.yaml): it receives OTLP/HTTP and
keeps only counts, because Jaeger's image cannot be obtained on a machine that reaches no registry.

The services export their spans to http://jaeger:4318/v1/traces as they would to Jaeger's collector;
this answers each export with an empty ExportTraceServiceResponse (an empty protobuf message is its
valid encoding), so the exporters neither retry nor log errors, and counts the exports and bytes.
``GET /`` on port 16686 (where Jaeger's UI would be) answers those counts as JSON, which is how the
compose smoke test sees that traces left the services. Spans are not decoded, stored or shown; for
a trace view, run Jaeger where its image can be pulled (compose.yaml as it is).
Standard library only: it runs on the local Python base image with nothing installed.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

OTLP_PORT, STATS_PORT = 4318, 16686
_lock = threading.Lock()
_counts = {"exports": 0, "bytes": 0, "rejected": 0}


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/v1/traces":
            with _lock:
                _counts["rejected"] += 1
            self.send_error(404, "only /v1/traces (OTLP/HTTP traces) is received here")
            return
        with _lock:
            _counts["exports"] += 1
            _counts["bytes"] += len(body)
        self.send_response(200)
        self.send_header("Content-Type", self.headers.get("Content-Type") or "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:  # one line per export would drown the container's log
        pass


class Stats(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        with _lock:
            body = json.dumps(_counts).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def main() -> None:
    stats = ThreadingHTTPServer(("0.0.0.0", STATS_PORT), Stats)
    threading.Thread(target=stats.serve_forever, daemon=True).start()
    print(f"otlp-sink: OTLP/HTTP on :{OTLP_PORT}/v1/traces, counts on :{STATS_PORT}/", file=sys.stderr, flush=True)
    ThreadingHTTPServer(("0.0.0.0", OTLP_PORT), Receiver).serve_forever()


if __name__ == "__main__":
    main()
