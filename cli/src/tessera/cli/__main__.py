"""`tessera`: the command line, a client of Tessera's public interfaces.

  tessera up                 run Tessera locally on a simulated fleet, live GPU table until Ctrl-C
  tessera demo               the same scenario to the end, a summary, exit 0
  tessera submit ...         ask for GPUs in HAMi's vocabulary
  tessera release CLAIM      give a claim back
  tessera status | claims    the fleet table / the claims table (-o json for scripts)
  tessera top | ui           the live fleet, in the terminal / in a browser
  tessera dlq list|replay    dead letters, and sending them back once
  tessera tenant ...         tenant control planes
  tessera bench ...          benchmarks (placement, tenants)
  tessera asyncapi           write (or --check) the AsyncAPI document of the subjects
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from rich.console import Console, Group
from rich.live import Live

from tessera.shared import api, identities, secretkeys
from tessera.shared import profile as profiles
from tessera.shared.bus import redact

from tessera.cli import exitcodes, scenario, views
from tessera.cli.client import Client, CliError, add_identity_args
from tessera.cli.cluster import LocalCluster
from tessera.cli.gpuflags import resources_from

console = Console()
err = Console(stderr=True)

REPO_ROOT = Path(__file__).resolve().parents[4] if len(Path(__file__).resolve().parents) > 4 else Path.cwd()


def _default_profile() -> str:
    candidate = REPO_ROOT / "profiles" / "demo.yaml"
    return str(candidate if candidate.exists() else Path("profiles/demo.yaml"))


# --- local system ----------------------------------------------------------------------------


def _start_cluster(args) -> LocalCluster:
    workdir = Path(args.workdir).resolve()
    if not args.keep_state:
        # A fresh scenario each time: the previous run's streams, buckets and claim directories go.
        for part in ("nats", "nats-auth", "state", "nats-url", "nats-url-viewer"):
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


async def _settle(client: Client, claims: list[str], timeout: float = 60) -> views.FleetState:
    deadline = time.monotonic() + timeout
    while True:
        state = await client.fleet()
        waiting = [c for c in claims if state.claims.get(c) is None or state.claims[c].state in ("requested", "allocated")]
        if not waiting or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.2)


async def cmd_up(args) -> int:
    cluster = _start_cluster(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    client = viewer = None
    try:
        client, _ = await _scenario(cluster.url)
        from tessera.cli import top, webui

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
        for c in (viewer, client):
            if c is not None:
                await c.close()
        err.print("[dim]•[/] stopping services")
        codes = cluster.stop()
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
        after = await client.fleet()
        left = sum(len(lg.entries) for lg in after.ledgers.values())
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


# --- client commands -------------------------------------------------------------------------


def _annotations(args) -> dict:
    ann = {}
    for flag, name in (("use_gputype", "nvidia.com/use-gputype"), ("nouse_gputype", "nvidia.com/nouse-gputype"),
                       ("use_gpuuuid", "nvidia.com/use-gpuuuid"), ("nouse_gpuuuid", "nvidia.com/nouse-gpuuuid"),
                       ("node_policy", "hami.io/node-scheduler-policy"), ("gpu_policy", "hami.io/gpu-scheduler-policy")):
        value = getattr(args, flag)
        if value:
            ann[name] = value
    return ann


async def cmd_submit(args) -> int:
    client = await Client.from_args(args)
    try:
        result = await client.submit(
            api.SubmitRequest(tenant=args.tenant, resources=resources_from(args), annotations=_annotations(args),
                              claim=args.claim, node=args.node)
        )
        claim = result["claim"]
        if not args.wait:
            if args.output == "json":
                _print_json({"claim": claim})
            else:
                console.print(claim)
            return exitcodes.OK
        record = await client.wait_for(claim, {"prepared", "running", "unschedulable", "failed"}, timeout=args.timeout)
        if args.output == "json":
            _print_json(msgspec.to_builtins(record))
        if record.state == "unschedulable":
            err.print(f"claim {claim} is unschedulable: {record.reason}")
            return exitcodes.UNSCHEDULABLE
        if record.state == "failed":
            err.print(f"claim {claim} failed: {record.reason}")
            return exitcodes.FAILED
        if args.output != "json":
            devices = ", ".join(f"{d.uuid} ({d.memory_mib} MiB, {d.cores}%)" for d in record.devices)
            console.print(f"{claim} {record.state} on {record.node}: {devices}")
        return exitcodes.OK
    finally:
        await client.close()


async def cmd_release(args) -> int:
    client = await Client.from_args(args)
    try:
        result = await client.release(args.claim)
        if args.wait:
            await client.wait_for(args.claim, {"released"}, timeout=args.timeout)
            result["state"] = "released"
        if args.output == "json":
            _print_json({"claim": args.claim, "state": result["state"]})
        else:
            console.print(f"{args.claim} {result['state']}")
        return exitcodes.OK
    finally:
        await client.close()


def _print_json(value) -> None:
    """JSON on stdout, nothing else there (diagnostics go to stderr): for `jq` and scripts."""
    import json

    print(json.dumps(value, indent=2, sort_keys=True))


async def cmd_status(args) -> int:
    client = await Client.from_args(args, read_only=True)
    try:
        snap = (await client.fleet()).model.snapshot()
    finally:
        await client.close()
    if args.output == "json":
        _print_json(snap)
    else:
        console.print(views.fleet_table(snap))
        console.print(views.snapshot_summary(snap))
        console.print(views.tenants_table(snap))
    return exitcodes.OK


async def cmd_claims(args) -> int:
    client = await Client.from_args(args, read_only=True)
    try:
        state = await client.fleet()
    finally:
        await client.close()
    if args.claim:
        missing = [c for c in args.claim if c not in state.claims]
        if missing:
            raise CliError(f"no such claim: {', '.join(missing)} (see 'tessera claims')")
        state.claims = {c: state.claims[c] for c in args.claim}
    if args.output == "json":
        _print_json([msgspec.to_builtins(c) for c in sorted(state.claims.values(), key=lambda c: c.updated)])
    else:
        console.print(views.claims_table(state))
    return exitcodes.OK


K8S_NATS = REPO_ROOT / "deploy" / "k8s" / "nats.yaml"


def write_k8s_platform_account(path: Path = K8S_NATS) -> None:
    """Regenerate nats.yaml's ``platform.conf`` from the identities table (after a new subject)."""
    text = path.read_text()
    head = "  platform.conf: |\n"
    start = text.index(head) + len(head)
    end = text.index("---\n", start)
    block = "".join(f"    {line}\n" if line else "\n" for line in identities.k8s_platform_account().splitlines())
    path.write_text(text[:start] + block + text[end:])


def cmd_secret_key(args) -> int:
    """The manager's sealing keys outside `make up` (compose mounts the file as a secret)."""
    out = Path(args.out)
    if args.rotate:
        secretkeys.rotate_key_file(out)
        console.print(f"{out}: a new key is first; restart the manager to re-seal every secret with it")
    elif secretkeys.write_key_file(out):
        console.print(f"wrote a new key to {out} (0600); keep it: the sealed secrets need it")
    else:
        console.print(f"{out} exists; left as it is (its keys open the stored secrets)")
    return 0


def cmd_nats_auth(args) -> int:
    """The authorization of a nats-server outside `make up`: compose's directory, or (--k8s)
    deploy/k8s/nats.yaml's generated platform account."""
    if args.k8s:
        write_k8s_platform_account()
        console.print(f"rewrote platform.conf in {K8S_NATS}")
        return 0
    if not args.out:
        raise CliError("give --out DIR (compose's authorization directory) or --k8s", code=exitcodes.USAGE)
    nodes = [n.node for n in profiles.load(args.profile)]
    out = Path(args.out)
    passwords = identities.write_auth_dir(out, nodes)
    console.print(f"wrote {out / 'nats.conf'} ({len(passwords)} users) and their passwords in {out / 'passwords'}")
    return 0


def cmd_asyncapi(args) -> int:
    from tessera.shared.asyncapi import render

    document = render()
    path = Path(args.output)
    if args.check:
        current = path.read_text() if path.exists() else ""
        if current != document:
            err.print(f"{path} is out of date: run 'tessera asyncapi' to regenerate it")
            return 1
        console.print(f"{path} is current")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document)
    console.print(f"wrote {path}")
    return 0


def cmd_bench(args) -> int:
    """Benchmarks live with the code they measure; the CLI runs them as separate programs."""
    targets = {
        "placement": [sys.executable, "-m", "tessera.placement.benchmarks.packing", "placement"],
        "placement-speed": [sys.executable, "-m", "tessera.placement.benchmarks.packing", "speed"],
        "placement-families": [sys.executable, "-m", "tessera.placement.benchmarks.packing", "placement", "--families"],
        "placement-dynamic": [sys.executable, "-m", "tessera.placement.benchmarks.packing", "dynamic"],
        "placement-nats": [sys.executable, "-m", "tessera.placement.benchmarks.through_nats"],
        "tenants": [sys.executable, "-m", "tessera.controlplane.bench"],
    }
    openb = Path(os.environ.get("TESSERA_OPENB_DIR") or REPO_ROOT.parent / "shared" / "data" / "openb")

    def command(name: str, rest: list[str]) -> list[str]:
        if name in ("placement", "placement-speed", "placement-families", "placement-dynamic") and "--nodes" not in rest:
            if not openb.exists():
                raise CliError(f"the openb trace is not at {openb}: pass --nodes/--pods or set TESSERA_OPENB_DIR")
            rest = ["--nodes", str(openb / "openb_node_list_gpu_node.csv"),
                    "--pods", str(openb / "openb_pod_list_default.csv"), *rest]
        return targets[name] + rest

    if args.what == "all":
        code = 0
        for name in ("placement", "placement-families", "placement-speed", "placement-nats", "tenants"):
            err.print(f"[bold]== bench {name}[/]")
            # (the service with its compiled core against the Python engine, side by side)
            rest = ["--models", "default,python-core"] if name == "placement-nats" else []
            if name == "placement-families":  # (the families table is kept in the repository)
                rest = ["--md", str(REPO_ROOT / "bench" / "placement_families.md")]
            code |= subprocess.call(command(name, rest))
        return code
    if args.what not in targets:
        raise CliError(f"unknown benchmark {args.what!r}; choose one of: all, {', '.join(targets)}")
    return subprocess.call(command(args.what, args.rest))


# --- parser ----------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera", description="Multi-tenant GPU sharing: the Tessera command line.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def local(name: str, help_: str):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--profile", default=_default_profile(), help="fleet profile YAML (default: profiles/demo.yaml)")
        sp.add_argument("--workdir", default=str(REPO_ROOT / ".run"), help="where NATS data and service logs go")
        sp.add_argument("--embedded", action="store_true", help="always start an embedded nats-server, even if TESSERA_NATS_URL is set")
        sp.add_argument("--keep-state", action="store_true", help="keep the previous run's NATS data and claims instead of starting fresh")
        return sp

    up = local("up", "run Tessera on a simulated fleet and show a live GPU table until Ctrl-C")
    up.add_argument("--ui-port", type=int, default=8470, help="port of the fleet view (default 8470; 0: any free one)")
    up.set_defaults(func=cmd_up)
    local("demo", "run the demo scenario to the end, print a summary and exit").set_defaults(func=cmd_demo)

    def client_cmd(name: str, help_: str):
        sp = sub.add_parser(name, help=help_, description=help_)
        add_identity_args(sp)
        return sp

    def output_arg(sp) -> None:
        sp.add_argument("-o", "--output", choices=("table", "json"), default="table",
                        help="table (default) or json: one JSON document on stdout, fields in docs/cli.md")

    s = client_cmd("submit", "ask for GPUs (HAMi resource names as flags)")
    s.add_argument("--tenant", required=True)
    s.add_argument("--gpus", type=int, default=1, help="nvidia.com/gpu: number of GPUs (default 1)")
    s.add_argument("--gpumem", type=int, help="nvidia.com/gpumem: MiB per GPU")
    s.add_argument("--gpumem-percent", type=int, help="nvidia.com/gpumem-percentage: percent of each card's memory")
    s.add_argument("--gpucores", type=int, help="nvidia.com/gpucores: percent of SMs per GPU (100 = exclusive)")
    s.add_argument("--priority", type=int, help="nvidia.com/priority")
    s.add_argument("--use-gputype"); s.add_argument("--nouse-gputype")
    s.add_argument("--use-gpuuuid"); s.add_argument("--nouse-gpuuuid")
    s.add_argument("--node-policy", help="hami.io/node-scheduler-policy"); s.add_argument("--gpu-policy", help="hami.io/gpu-scheduler-policy")
    s.add_argument("--claim", help="your own claim id (makes retries idempotent)")
    s.add_argument("--node", help="pin the claim to one node")
    s.add_argument("--wait", action="store_true", help="wait until the claim is prepared or unschedulable")
    s.add_argument("--timeout", type=float, default=30)
    output_arg(s)
    s.set_defaults(func=cmd_submit)

    r = client_cmd("release", "give a claim back")
    r.add_argument("claim")
    r.add_argument("--wait", action="store_true")
    r.add_argument("--timeout", type=float, default=30)
    output_arg(r)
    r.set_defaults(func=cmd_release)

    st = client_cmd("status", "the fleet: GPUs and their slices per tenant, fragmentation, tenants' quota use")
    output_arg(st)
    st.set_defaults(func=cmd_status)
    cl = client_cmd("claims", "every claim and its state (or only the claims named)")
    cl.add_argument("claim", nargs="*", help="claim ids (default: every claim)")
    output_arg(cl)
    cl.set_defaults(func=cmd_claims)

    from tessera.cli import dlq, top

    tp = client_cmd("top", "the live fleet in the terminal, redrawn on every change")
    tp.add_argument("--screen", action="store_true", help="use the whole terminal (alternate screen)")
    tp.set_defaults(func=top.cmd_top)
    ui = client_cmd("ui", "serve the live fleet view (a web page) until Ctrl-C")
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ui.add_argument("--port", type=int, default=8470, help="port (default 8470; 0: any free one)")
    ui.set_defaults(func=top.cmd_ui)
    dlq.register(sub, output_arg)

    n = sub.add_parser("nats-auth", help="write a nats-server authorization directory: one user per service and node")
    n.add_argument("--out", help="directory for nats.conf, tenants.conf and passwords/")
    n.add_argument("--k8s", action="store_true", help="rewrite deploy/k8s/nats.yaml's platform account instead")
    n.add_argument("--profile", default=_default_profile(), help="fleet profile YAML: one enforcer user per node")
    n.set_defaults(func=cmd_nats_auth)

    k = sub.add_parser("secret-key", help="create the control-plane manager's secret-key file (0600) if it is absent")
    k.add_argument("--out", required=True, help="the file (TESSERA_CP_SECRET_KEY_FILE of the manager)")
    k.add_argument("--rotate", action="store_true", help="put a new key first; the others stay, to open older values")
    k.set_defaults(func=cmd_secret_key)

    a = sub.add_parser("asyncapi", help="write the AsyncAPI document of Tessera's subjects")
    a.add_argument("--output", default=str(REPO_ROOT / "docs" / "asyncapi.json"))
    a.add_argument("--check", action="store_true", help="fail if the document is out of date")
    a.set_defaults(func=cmd_asyncapi)

    b = sub.add_parser("bench", help="run a benchmark: all, placement, placement-families, placement-dynamic, placement-speed, placement-nats, tenants")
    b.add_argument("what")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(func=cmd_bench)

    try:
        from tessera.cli import tenant

        tenant.register(sub)
    except ImportError:  # the tenant commands ship with the control-plane manager's client module
        pass
    try:
        from tessera.cli import run as run_cmd

        run_cmd.register(sub)
    except ImportError:
        pass
    return p


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every `finally` that stops services runs.
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        handler = getattr(args, "func", None) or args.run  # `tenant` subcommands name theirs `run`
        result = handler(args)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        return int(result or 0)
    except CliError as exc:
        err.print(f"[red]error:[/] {exc}")
        return exc.code
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED
    except Exception as exc:  # a clear line, not a traceback, for what the user can act on
        from tessera.shared.errors import ConfigError

        if isinstance(exc, (ConfigError, RuntimeError, OSError)):
            err.print(f"[red]error:[/] {exc}")
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
