"""Not a test of the suite (its name keeps it out of collection): tests/kit/test_interrupted_run.py runs
it in a pytest of its own, named on the command line, so that tests/conftest.py and the pyproject's
settings apply as in `make test`. It starts, through the kit's session fixtures, the servers an
interrupted run used to leave behind (a real control plane, a real node's containerd and kubelet,
PostgreSQL), writes their pids where TESSERA_INTERRUPTED_RUN_PIDS says, and waits to be interrupted
(in its event loop, as most of the suite's tests wait). Its second test waits the way a test whose
code swallows the cancellation does (a wait loop that catches CancelledError): the interrupt's first
step, cancelling the test's task, does not end it.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path


async def test_waits_to_be_interrupted_with_servers_running(kube_plane, kube_node, postgres):
    where = os.environ.get("TESSERA_INTERRUPTED_RUN_PIDS")
    assert where, "run only by tests/kit/test_interrupted_run.py, which sets TESSERA_INTERRUPTED_RUN_PIDS"
    pids = {f"plane {name}": proc.pid for name, proc in kube_plane.procs.items()}
    pids |= {f"node {name}": proc.pid for name, proc in kube_node.procs.items()}
    pids["postgres"] = int((postgres.datadir / "data" / "postmaster.pid").read_text().split()[0])
    Path(where + ".tmp").write_text(json.dumps({"pids": pids, "bridge": kube_node.bridge}))
    os.replace(where + ".tmp", where)
    await asyncio.sleep(600)  # the outer test interrupts this run long before


async def test_swallows_the_cancellation_it_is_sent(postgres):
    where = os.environ.get("TESSERA_INTERRUPTED_RUN_PIDS")
    assert where, "run only by tests/kit/test_interrupted_run.py, which sets TESSERA_INTERRUPTED_RUN_PIDS"
    pid_file = postgres.datadir / "data" / "postmaster.pid"
    started = {"pids": {"postgres": int(pid_file.read_text().split()[0])}, "postmaster_pid": str(pid_file)}
    Path(where + ".tmp").write_text(json.dumps(started))
    os.replace(where + ".tmp", where)
    for _ in range(600):
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:  # (the swallowing is the point)
            continue
