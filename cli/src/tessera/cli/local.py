"""`tessera up` and `tessera demo`: Tessera on this machine (`LocalCluster`) with the demo scenario.

Both start the embedded nats-server and the five services from the checkout's fleet profile, create
the demo tenants and submit the demo workload (`tessera.cli.scenario`); `up` then shows the live
fleet until Ctrl-C, `demo` waits for the workload to settle, prints a summary and releases it all.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live

from tessera.shared import api, identities, subjects
from tessera.shared.bus import redact

from tessera.cli import checkout, scenario, top, views, webui
from tessera.cli.client import Client, FleetState
from tessera.cli.cluster import LocalCluster
from tessera.cli.errors import CliError

console = Console()
err = Console(stderr=True)


def default_profile() -> str:
    """The checkout's profiles/demo.yaml, else profiles/demo.yaml under the working directory."""
    root = checkout.find()
    candidate = root / "profiles" / "demo.yaml" if root is not None else None
    return str(candidate if candidate is not None and candidate.exists() else Path("profiles/demo.yaml"))


def register(sub: argparse._SubParsersAction) -> None:
    def local(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--profile", default=default_profile(), help="fleet profile YAML (default: profiles/demo.yaml)")
        sp.add_argument("--workdir", default=None, help="where NATS data and service logs go (default: the checkout's .run)")
        sp.add_argument("--embedded", action="store_true", help="always start an embedded nats-server, even if TESSERA_NATS_URL is set")
        sp.add_argument("--keep-state", action="store_true", help="keep the previous run's NATS data and claims instead of starting fresh")
        return sp

    up = local("up", "run Tessera on a simulated fleet and show a live GPU table until Ctrl-C")
    up.add_argument("--ui-port", type=int, default=8470, help="port of the fleet view (default 8470; 0: any free one)")
    up.set_defaults(func=cmd_up)
    local("demo", "run the demo scenario to the end, print a summary and exit").set_defaults(func=cmd_demo)


def _workdir(args) -> Path:
    if args.workdir:
        return Path(args.workdir).resolve()
    return checkout.require(f"tessera {args.command} without --workdir") / ".run"


def _start_cluster(args, *, control_planes: bool = False) -> LocalCluster:
    """``control_planes``: the manager runs each tenant's control plane (kube-apiserver, controller
    manager, scheduler, kine) as its own processes, within their rendered CPU and memory limits, and
    stops them when it stops (`tessera up`; `make up` builds their binaries first)."""
    workdir = _workdir(args)
    if not args.keep_state:
        # A fresh scenario each time: the previous run's streams, buckets and claim directories go.
        for part in ("nats", "nats-auth", "state", "nats-url", "nats-url-viewer", "control-planes"):
            target = workdir / part
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    reuse = os.environ.get("TESSERA_NATS_URL") if not args.embedded else None
    cluster = LocalCluster(
        workdir=workdir,
        profile=Path(args.profile).resolve(),
        nats_url=reuse,
        otlp_endpoint=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        extra_env={"TESSERA_CP_HOST": "local", "TESSERA_CP_CONTROL_PLANES_DIR": str(workdir / "control-planes"),
                   "TESSERA_CP_STOP_PLANES_ON_EXIT": "true"} if control_planes else {},
    )
    cluster.start(progress=lambda m: err.print(f"[dim]•[/] {m}"))
    try:
        err.print("[dim]•[/] waiting for services to be ready")
        cluster.wait_ready(timeout=90)
    except Exception:
        cluster.stop()
        raise
    err.print(f"[dim]•[/] NATS at {redact(cluster.url)} (full URL in {workdir / 'nats-url'}); logs in {workdir / 'logs'}")
    return cluster


async def _scenario(url: str) -> tuple[Client, list[str]]:
    client = await Client.connect(url)
    err.print("[dim]•[/] creating tenants " + ", ".join(scenario.TENANTS))
    await scenario.create_tenants(client)
    claims = await scenario.submit_workload(client)
    err.print(f"[dim]•[/] submitted {len(claims)} claims")
    return client, claims


async def _settle(client: Client, claims: list[str], timeout: float = 60) -> FleetState:
    deadline = time.monotonic() + timeout
    while True:
        state = await client.fleet()
        waiting = [c for c in claims if state.claims.get(c) is None or state.claims[c].state in ("requested", "allocated")]
        if not waiting or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.2)


async def ledger_entries_left(client: Client, timeout: float = 15) -> int:
    """The ledger entries still held once every claim's record says ``released``, after giving
    the releases under way ``timeout`` seconds to finish: a record says ``released`` before its
    entry goes (the enforcer removes the entry last, so that whoever finds it finishes a release
    stopped midway), so one read right after the last record changed may find that entry still
    there. An entry left after the timeout is a leak."""
    deadline = time.monotonic() + timeout
    while True:
        after = await client.fleet()
        left = sum(len(lg.entries) for lg in after.ledgers.values())
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.2)


async def _report_control_planes(client: Client, started: float) -> None:
    """Say when each demo tenant's API server first answers (or why not yet), once each."""
    said: dict[str, str] = {}
    while len([p for p in said.values() if p == "Ready"]) < len(scenario.TENANTS):
        reply = await client.request(f"{subjects.API_TENANTS}.list", api.TenantRequest(), timeout=10)
        for t in (reply.result or []) if reply.ok else []:
            if said.get(t["name"]) != t["phase"] and (t["phase"] == "Ready" or t["reason"] != "WaitingForControlPlane"):
                said[t["name"]] = t["phase"]
                err.print(f"[dim]•[/] tenant {t['name']}: control plane {t['phase']} after "
                          f"{time.monotonic() - started:.0f} s" + (f" ({t['reason']}: {t['message'][:160]})"
                                                                     if t["phase"] != "Ready" else
                                                                     f" at {t['endpoint']}"))
        await asyncio.sleep(2)


async def cmd_up(args) -> int:
    cluster = _start_cluster(args, control_planes=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    client = viewer = None
    planes: asyncio.Task | None = None
    try:
        started = time.monotonic()
        client, _ = await _scenario(cluster.url)
        planes = asyncio.create_task(_report_control_planes(client, started), name="control-planes")
        viewer = await Client.connect(cluster.url_for(identities.VIEWER) if cluster.nats else cluster.url)
        async with top.live_model(viewer) as (model, _feed):
            async with webui.serving(model, "127.0.0.1", args.ui_port) as url:
                err.print(f"[dim]•[/] [bold]fleet view at {url}[/] (live; read-only NATS identity 'viewer')")
                with Live(console=console, refresh_per_second=2, screen=False) as live:
                    while not stop.is_set():
                        snap = model.snapshot()
                        live.update(Group(views.fleet_table(snap), views.snapshot_summary(snap),
                                          f"[dim]fleet view at {url} · Ctrl-C stops everything[/]"))
                        dead = cluster.dead()
                        if dead:
                            raise CliError(f"{dead[0].name} stopped unexpectedly; see {dead[0].log_path}")
                        try:
                            await asyncio.wait_for(stop.wait(), timeout=1.0)
                        except asyncio.TimeoutError:
                            pass
    finally:
        if planes is not None:
            planes.cancel()
            await asyncio.gather(planes, return_exceptions=True)
        for c in (viewer, client):
            if c is not None:
                await c.close()
        err.print("[dim]•[/] stopping services and the tenants' control planes")
        codes = cluster.stop(timeout=30)  # (the manager stops the control planes first)
        bad = {k: v for k, v in codes.items() if v not in (0, -signal.SIGTERM)}
        err.print("[dim]•[/] stopped" + (f" (non-zero exits: {bad})" if bad else " cleanly"))
    return 0


async def cmd_demo(args) -> int:
    cluster = _start_cluster(args)
    client = None
    try:
        client, claims = await _scenario(cluster.url)
        state = await _settle(client, claims)
        console.print(views.gpu_table(state, title="Tessera fleet after the demo workload"))
        console.print(views.summary(state))
        console.print(views.claims_table(state))
        by_state = {c: state.claims[c].state for c in claims if c in state.claims}
        prepared = sum(1 for s in by_state.values() if s == "prepared")
        unsched = [state.claims[c] for c in claims if by_state.get(c) == "unschedulable"]
        err.print("[dim]•[/] releasing every claim")
        for claim in claims:
            await client.release(claim, reason="demo finished")
        for claim in claims:
            await client.wait_for(claim, {"released"}, timeout=30)
        left = await ledger_entries_left(client)
        console.print(
            f"\n[bold]demo summary[/]: {len(claims)} claims, {prepared} prepared on GPUs, "
            f"{len(unsched)} unschedulable"
            + (f" ({unsched[0].reason})" if unsched else "")
            + f"; all released, ledger entries left: {left}"
        )
        if left:
            raise CliError("the ledger still holds allocations after every claim was released")
        return 0
    finally:
        if client is not None:
            await client.close()
        cluster.stop()
