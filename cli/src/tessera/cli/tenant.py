"""`tessera tenant create|get|list|delete|kubeconfig|sleep|wake`: a client of the control-plane manager's NATS API.

The CLI knows the manager only through its public request/reply subjects
(tessera.api.tenants.<verb>) and the shared request/reply types; it never imports the manager. It
asks through the same `Client` as every other command. Replies are shown as a table (or JSON with
--json); a refusal prints the manager's message and the field it names, and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import msgspec
import yaml

from tessera.shared import subjects
from tessera.shared.api import TenantRequest
from tessera.shared.events import GpuQuota

from tessera.cli import exitcodes
from tessera.cli.client import Client
from tessera.cli.errors import CliError
from tessera.cli.options import add_identity_args


def register(sub: argparse._SubParsersAction) -> None:
    """``tenant`` with its four subcommands, each with its handler as ``func``."""
    tenant = sub.add_parser("tenant", help="create, inspect and delete tenants")
    verbs = tenant.add_subparsers(dest="tenant_command",
                                  metavar="{create,get,list,delete,kubeconfig,sleep,wake}")
    verbs.required = True

    def common(p: argparse.ArgumentParser) -> None:
        add_identity_args(p)
        p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the manager")
        p.add_argument("--json", action="store_true", help="print the raw reply as JSON (the same as -o json)")
        p.add_argument("-o", "--output", choices=("table", "json"), default="table",
                       help="json: the manager's reply as one JSON document on stdout (fields in docs/cli.md)")

    create = verbs.add_parser("create", help="create a tenant (or change its spec; repeating is harmless)")
    create.add_argument("name")
    create.add_argument("--gpus", type=int, help="GPU count quota")
    create.add_argument("--memory-mib", type=int, help="GPU memory quota in MiB (sum over GPUs)")
    create.add_argument("--cores", type=int, help="GPU core quota (sum of per-GPU percents)")
    create.add_argument("--borrow-gpus", type=int, metavar="N",
                        help="may borrow idle capacity up to N GPUs beyond its quota (preemptible by reclaim)")
    create.add_argument("--borrow-memory-mib", type=int, metavar="MIB", help="borrowing limit in GPU memory")
    create.add_argument("--borrow-cores", type=int, metavar="PERCENT", help="borrowing limit in GPU cores")
    create.add_argument("--weight", type=int,
                        help="fair-share weight: of several borrowers, the lowest share borrowed / weight goes first")
    create.add_argument("--size", choices=("small", "medium", "large"), help="control-plane size class")
    create.add_argument("--datastore", choices=("nats", "postgres", "etcd"), help="datastore driver")
    create.add_argument("--replicas", type=int, help="control-plane replicas")
    create.add_argument("--kubernetes-version", help="e.g. v1.33.1")
    create.add_argument("--spec", type=Path, help="a TenantControlPlane spec (YAML or JSON); flags override it")
    common(create)
    create.set_defaults(func=run_create)

    get = verbs.add_parser("get", help="show one tenant")
    get.add_argument("name")
    common(get)
    get.set_defaults(func=run_get)

    lst = verbs.add_parser("list", help="list tenants")
    common(lst)
    lst.set_defaults(func=run_list)

    delete = verbs.add_parser("delete", help="delete a tenant and everything it owns")
    delete.add_argument("name")
    common(delete)
    delete.set_defaults(func=run_delete)

    kubeconfig = verbs.add_parser("kubeconfig", help="print the tenant's admin kubeconfig (for kubectl)")
    kubeconfig.add_argument("name")
    common(kubeconfig)
    kubeconfig.set_defaults(func=run_kubeconfig)

    for verb, text in (("sleep", "stop the tenant's control plane, keeping its data (scale to zero)"),
                       ("wake", "start a sleeping tenant's control plane; says how long until it answered")):
        p = verbs.add_parser(verb, help=text)
        p.add_argument("name")
        common(p)
        p.set_defaults(func=run_sleep_or_wake, verb=verb)


# --- handlers --------------------------------------------------------------------------------


async def run_create(args: argparse.Namespace) -> int:
    try:
        spec = _spec_from_args(args)
    except ValueError as exc:
        print(f"tessera tenant create: {exc}", file=sys.stderr)
        return exitcodes.USAGE
    quota = None
    if any(v is not None for v in (args.gpus, args.memory_mib, args.cores)):
        quota = GpuQuota(gpus=args.gpus, memory_mib=args.memory_mib, cores=args.cores)
    req = TenantRequest(name=args.name, quota=quota, spec=spec or None)
    return await _call(args, "create", req, lambda r: print(render_detail(r)))


async def run_get(args: argparse.Namespace) -> int:
    return await _call(args, "get", TenantRequest(name=args.name), lambda r: print(render_detail(r)))


async def run_list(args: argparse.Namespace) -> int:
    return await _call(args, "list", TenantRequest(), lambda r: print(render_table(r)))


async def run_delete(args: argparse.Namespace) -> int:
    def show(result: dict) -> None:
        if result.get("pending"):  # its claims are still being released; the manager carries on
            print(f"tenant {result.get('name')} is being deleted ({result.get('reason')}): {result.get('message')}")
            return
        word = "deleted" if result.get("existed") else "was already gone"
        print(f"tenant {result.get('name')} {word}")

    return await _call(args, "delete", TenantRequest(name=args.name), show)


async def run_kubeconfig(args: argparse.Namespace) -> int:
    return await _call(args, "kubeconfig", TenantRequest(name=args.name),
                       lambda r: print(r["kubeconfig"], end="" if r["kubeconfig"].endswith("\n") else "\n"))


async def run_sleep_or_wake(args: argparse.Namespace) -> int:
    def show(result: dict) -> None:
        t = result["tenant"]
        print(f"tenant {t['name']}: {t['phase']} ({t['reason']}) after {result['seconds']:.2f} s")

    return await _call(args, args.verb, TenantRequest(name=args.name), show)


# --- plumbing --------------------------------------------------------------------------------


async def _call(args: argparse.Namespace, verb: str, req: TenantRequest, show) -> int:
    """Ask the manager; print its reply (``show``, or JSON) or its refusal; the exit code."""
    try:
        client = await Client.from_args(args, claims=False)  # the manager only: no bucket to bind
    except CliError as exc:
        print(f"tessera tenant {verb}: {exc}", file=sys.stderr)
        return exc.code
    try:
        reply = await client.request(f"{subjects.API_TENANTS}.{verb}", req, timeout=args.timeout)
    except CliError as exc:
        print(f"tessera tenant {verb}: {exc} (is tessera-controlplane running?)", file=sys.stderr)
        return exc.code
    finally:
        await client.close()
    if args.json or args.output == "json":
        print(json.dumps(msgspec.to_builtins(reply), indent=2, sort_keys=True))
        return exitcodes.OK if reply.ok else exitcodes.FAILED
    if not reply.ok:
        err = reply.error
        where = f" [{err.field}]" if err and err.field else ""
        print(f"tessera tenant {verb}: {err.code if err else 'error'}{where}: {err.message if err else ''}",
              file=sys.stderr)
        return exitcodes.FAILED
    show(reply.result)
    return exitcodes.OK


def _spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if args.spec is not None:
        try:
            loaded = yaml.safe_load(args.spec.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read --spec {args.spec}: {exc}") from None
        if isinstance(loaded, dict) and loaded.get("kind") == "TenantControlPlane":
            loaded = loaded.get("spec") or {}  # a whole custom resource: take its spec
        if not isinstance(loaded, dict):
            raise ValueError(f"--spec {args.spec} must hold a mapping (the TenantControlPlane spec)")
        spec = loaded
    if args.size:
        spec["size"] = args.size
    if args.datastore:
        spec.setdefault("datastore", {})["driver"] = args.datastore
    if args.replicas is not None:
        spec.setdefault("kubernetes", {})["replicas"] = args.replicas
    if args.kubernetes_version:
        spec.setdefault("kubernetes", {})["version"] = args.kubernetes_version
    limit = {k: v for k, v in (("gpus", args.borrow_gpus), ("memoryMib", args.borrow_memory_mib),
                                ("cores", args.borrow_cores)) if v is not None}
    if limit:
        spec.setdefault("quota", {})["borrowingLimit"] = limit
    if args.weight is not None:
        spec.setdefault("quota", {})["weight"] = args.weight
    return spec


# --- views -----------------------------------------------------------------------------------

# GPUS, GPU MEM MiB and CORES: the quota, what the tenant is guaranteed; IN USE and BORROWED (of
# it, beyond the guarantee) as gpus/MiB/cores.
COLUMNS = ("NAME", "PHASE", "GPUS", "GPU MEM MiB", "CORES", "SIZE", "DATASTORE", "REPLICAS", "AGE",
           "IN USE", "BORROWED")


def _q(value: Any) -> str:
    return "-" if value is None else str(value)


def _age(created: float | None) -> str:
    if not created:
        return "-"
    s = max(0, int(time.time() - created))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def _row(t: dict) -> tuple[str, ...]:
    q = t.get("quota") or {}
    return (
        t.get("name", ""), t.get("phase", ""), _q(q.get("gpus")), _q(q.get("memory_mib")),
        _q(q.get("cores")), t.get("size", ""), t.get("driver", ""), _q(t.get("replicas")),
        _age(t.get("created")), _amount(t.get("in_use")), _amount(t.get("borrowed")),
    )


def _amount(q: dict | None) -> str:
    """gpus/MiB/cores, or "-" where not known."""
    if q is None:
        return "-"
    return "/".join(_q(q.get(k)) for k in ("gpus", "memory_mib", "cores"))


def _quota_line(q: dict) -> str:
    return f"gpus={_q(q.get('gpus'))} memory_mib={_q(q.get('memory_mib'))} cores={_q(q.get('cores'))}"


def _borrowing(t: dict) -> str:
    limit = t.get("borrowing_limit")
    if limit is None:
        return "none (the quota is a hard wall)"
    return f"{_quota_line(limit)} beyond the quota, weight {t.get('weight', 1)}"


def render_table(tenants: Sequence[dict]) -> str:
    rows = [COLUMNS, *(_row(t) for t in tenants)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if not tenants:
        lines.append("(no tenants)")
    return "\n".join(lines)


def render_detail(t: dict) -> str:
    q = t.get("quota") or {}
    fields = [
        ("Name", t.get("name")), ("Phase", t.get("phase")), ("Reason", t.get("reason") or "-"),
        ("Message", t.get("message") or "-"),
        ("GPU quota", f"{_quota_line(q)} (guaranteed)"),
        ("Borrowing limit", _borrowing(t)),
        ("In use", "-" if t.get("in_use") is None else _quota_line(t["in_use"])),
        ("Borrowed", "-" if t.get("borrowed") is None else f"{_quota_line(t['borrowed'])} (beyond the guarantee)"),
        ("Size", t.get("size")),
        ("Replicas", f"0 (asleep; a wake scales it to {t.get('replicas')})" if t.get("asleep") else t.get("replicas")),
        ("Last wake", f"{t['wake_seconds']:.2f} s until Ready" if t.get("wake_seconds") else "-"),
        ("Kubernetes", t.get("kubernetes_version")),
        ("Datastore", f"{t.get('driver')} {t.get('datastore') or ''}".strip()),
        ("Endpoint", t.get("endpoint") or "-"),
        ("GPU pods", t.get("gpu_pods") or "-"),
        ("Generation", f"{t.get('observed_generation')}/{t.get('generation')} observed"),
        ("Age", _age(t.get("created"))),
    ]
    width = max(len(k) for k, _ in fields)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in fields)
