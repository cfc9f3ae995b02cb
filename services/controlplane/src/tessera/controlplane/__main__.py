"""Entry point of the control-plane manager (`tessera-controlplane`): wire the parts, run the tasks.

Root tasks: one request/reply server per API verb (tessera.api.tenants.<verb>) and the resync loop
that reconciles every stored tenant on start-up and then periodically, which is how a restarted
manager converges and how certificates get rotated before they expire; with a metrics listener, the
watches behind its tenant books (`tessera.controlplane.metrics`).
"""

from __future__ import annotations

import logging
from typing import Coroutine, Mapping

from tessera.controlplane.app import Manager
from tessera.controlplane.metrics import TenantBooks
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared import runner, subjects
from tessera.shared.runner import ServiceContext

log = logging.getLogger("tessera.controlplane")

SERVICE = "controlplane"


async def build(ctx: ServiceContext, settings: ControlPlaneSettings) -> Mapping[str, Coroutine]:
    manager = await Manager.start(ctx.bus, settings)
    converged = ctx.gate("converged")
    tasks: dict[str, Coroutine] = {
        f"api-{verb}": ctx.bus.serve(f"{subjects.API_TENANTS}.{verb}", handler)
        for verb, handler in manager.api.handlers().items()
    }
    tasks.update(manager.root_tasks(on_first=converged))
    if ctx.settings.metrics_port:  # the books are kept only for a listener to serve
        books = TenantBooks(ctx.bus)
        ctx.metrics.add(books)
        tasks.update(books.tasks())
    return tasks


def main() -> int:
    return runner.main(SERVICE, ControlPlaneSettings, build)


if __name__ == "__main__":
    raise SystemExit(main())
