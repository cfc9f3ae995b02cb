"""`kubectl logs` in the tenant's cluster, served from the host.

The tenant's API server asks a node's kubelet for a container's log at
`https://<node address>:<kubeletEndpoint port>/containerLogs/<namespace>/<pod>/<container>`. For
the virtual node, this small HTTPS server answers there (with a serving certificate from the
tenant's CA) by streaming the mirrored pod's log from the host's API server (`pods/log` in the
tenant's host namespace, the syncer's host identity). Nothing else of the kubelet's API is served:
exec, attach and port-forward answer 404.
"""

from __future__ import annotations

import ssl
import tempfile
from pathlib import Path

from aiohttp import web

from tessera.shared.kubeapi import KubeApi, KubeError

from . import hostpod

# the kubelet's query parameters for logs, passed through to the host's pods/log
_PASSED = ("follow", "previous", "timestamps", "sinceSeconds", "sinceTime", "tailLines", "limitBytes")


class LogServer:
    def __init__(self, host_api: KubeApi, host_namespace: str, cert_pem: str, key_pem: str,
                 address: str = "127.0.0.1", port: int = 0) -> None:
        self.host_api, self.host_namespace = host_api, host_namespace
        self.cert_pem, self.key_pem = cert_pem, key_pem
        self.address, self.port = address, port
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Serve; returns the port (the node's kubeletEndpoint)."""
        app = web.Application()
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._logs)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.address, self.port, ssl_context=self._tls())
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    def _tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        with tempfile.TemporaryDirectory() as directory:  # (the ssl module reads files only)
            cert, key = Path(directory) / "tls.crt", Path(directory) / "tls.key"
            cert.write_text(self.cert_pem)
            key.write_text(self.key_pem)
            key.chmod(0o600)
            context.load_cert_chain(cert, key)
        return context

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        match = request.match_info
        query = [("container", match["container"])] + [(k, v) for k, v in request.query.items() if k in _PASSED]
        path = (f"/api/v1/namespaces/{self.host_namespace}/pods/"
                f"{hostpod.host_name(match['namespace'], match['pod'])}/log")
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        chunks = self.host_api.stream(path, query)
        try:
            first = await anext(chunks, b"")
        except KubeError as exc:
            return web.Response(status=exc.status or 502, text=f"the host answered: {exc}\n")
        await response.prepare(request)
        await response.write(first)
        async for chunk in chunks:
            await response.write(chunk)
        await response.write_eof()
        return response

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
