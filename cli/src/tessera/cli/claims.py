"""`tessera submit | release | status | claims`: the claim API and the fleet's state, one read each.

Requests go to the translator's public subjects, reads to the documented buckets, through `Client`.
With ``-o json`` a command prints one JSON document on stdout and nothing else there (fields in
docs/cli.md), for `jq` and scripts.
"""

from __future__ import annotations

import argparse
import json

import msgspec
from rich.console import Console

from tessera.shared import api

from tessera.cli import exitcodes, views
from tessera.cli.client import Client
from tessera.cli.errors import CliError
from tessera.cli.gpuflags import add_gpu_flags, annotations_from, resources_from
from tessera.cli.options import add_output_arg, client_command

console = Console()
err = Console(stderr=True)


def register(sub: argparse._SubParsersAction) -> None:
    s = client_command(sub, "submit", "ask for GPUs (HAMi resource names as flags)")
    s.add_argument("--tenant", required=True)
    add_gpu_flags(s)
    s.add_argument("--claim", help="your own claim id (makes retries idempotent)")
    s.add_argument("--node", help="pin the claim to one node")
    s.add_argument("--wait", action="store_true", help="wait until the claim is prepared or unschedulable")
    s.add_argument("--timeout", type=float, default=30)
    add_output_arg(s)
    s.set_defaults(func=cmd_submit)

    r = client_command(sub, "release", "give a claim back")
    r.add_argument("claim")
    r.add_argument("--wait", action="store_true")
    r.add_argument("--timeout", type=float, default=30)
    add_output_arg(r)
    r.set_defaults(func=cmd_release)

    st = client_command(sub, "status", "the fleet: GPUs and their slices per tenant, fragmentation, tenants' quota use")
    add_output_arg(st)
    st.set_defaults(func=cmd_status)
    cl = client_command(sub, "claims", "every claim and its state (or only the claims named)")
    cl.add_argument("claim", nargs="*", help="claim ids (default: every claim)")
    add_output_arg(cl)
    cl.set_defaults(func=cmd_claims)


def _print_json(value) -> None:
    """JSON on stdout, nothing else there (diagnostics go to stderr): for `jq` and scripts."""
    print(json.dumps(value, indent=2, sort_keys=True))


async def cmd_submit(args) -> int:
    client = await Client.from_args(args)
    try:
        result = await client.submit(
            api.SubmitRequest(tenant=args.tenant, resources=resources_from(args), annotations=annotations_from(args),
                              claim=args.claim, node=args.node, scheduling_priority=args.scheduling_priority)
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
