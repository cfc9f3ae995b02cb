"""The operator's setup commands outside `make up`: `nats-auth`, `secret-key`, `asyncapi`, `bench`.

They write files (a nats-server's authorization, the manager's sealing keys, the AsyncAPI document)
or run the benchmarks as separate programs; the defaults that name files in the repository are
found through `tessera.cli.checkout`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from tessera.shared import identities, secretkeys
from tessera.shared import profile as profiles
from tessera.shared.asyncapi import render

from tessera.cli import checkout, exitcodes
from tessera.cli.errors import CliError
from tessera.cli.local import default_profile

console = Console()
err = Console(stderr=True)


def register(sub: argparse._SubParsersAction) -> None:
    n = sub.add_parser("nats-auth", help="write a nats-server authorization directory: one user per service and node")
    n.add_argument("--out", help="directory for nats.conf, tenants.conf and passwords/")
    n.add_argument("--k8s", action="store_true", help="rewrite deploy/k8s/nats.yaml's platform account instead")
    n.add_argument("--profile", default=default_profile(), help="fleet profile YAML: one enforcer user per node")
    n.set_defaults(func=cmd_nats_auth)

    k = sub.add_parser("secret-key", help="create the control-plane manager's secret-key file (0600) if it is absent")
    k.add_argument("--out", required=True, help="the file (TESSERA_CP_SECRET_KEY_FILE of the manager)")
    k.add_argument("--rotate", action="store_true", help="put a new key first; the others stay, to open older values")
    k.set_defaults(func=cmd_secret_key)

    a = sub.add_parser("asyncapi", help="write the AsyncAPI document of Tessera's subjects")
    a.add_argument("--output", default=None, help="the document (default: the checkout's docs/asyncapi.json)")
    a.add_argument("--check", action="store_true", help="fail if the document is out of date")
    a.set_defaults(func=cmd_asyncapi)

    b = sub.add_parser("bench", help="run a benchmark: all, placement, placement-families, placement-dynamic, placement-speed, placement-nats, tenants, tenant-planes, vgpu-launch, kubernetes, tenant-pods, tenant-wake-kubernetes")
    b.add_argument("what")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(func=cmd_bench)


def k8s_nats_manifest() -> Path:
    return checkout.require("tessera nats-auth --k8s") / "deploy" / "k8s" / "nats.yaml"


def write_k8s_platform_account(path: Path | None = None) -> Path:
    """Regenerate nats.yaml's ``platform.conf`` from the identities table (after a new subject)."""
    path = path or k8s_nats_manifest()
    text = path.read_text()
    head = "  platform.conf: |\n"
    start = text.index(head) + len(head)
    end = text.index("---\n", start)
    block = "".join(f"    {line}\n" if line else "\n" for line in identities.k8s_platform_account().splitlines())
    path.write_text(text[:start] + block + text[end:])
    return path


def openb_dir() -> Path:
    """$TESSERA_OPENB_DIR, else the shared data directory beside the checkout."""
    if os.environ.get("TESSERA_OPENB_DIR"):
        return Path(os.environ["TESSERA_OPENB_DIR"])
    return checkout.require("the openb trace without TESSERA_OPENB_DIR").parent / "shared" / "data" / "openb"


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
        path = write_k8s_platform_account()
        console.print(f"rewrote platform.conf in {path}")
        return 0
    if not args.out:
        raise CliError("give --out DIR (compose's authorization directory) or --k8s", code=exitcodes.USAGE)
    nodes = [n.node for n in profiles.load(args.profile)]
    out = Path(args.out)
    passwords = identities.write_auth_dir(out, nodes)
    console.print(f"wrote {out / 'nats.conf'} ({len(passwords)} users) and their passwords in {out / 'passwords'}")
    return 0


def cmd_asyncapi(args) -> int:
    document = render()
    path = Path(args.output) if args.output else checkout.require("tessera asyncapi without --output") / "docs" / "asyncapi.json"
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
        "tenants": [sys.executable, "-m", "tessera.controlplane.benchmarks.tenants"],
        # libvgpu's launch hooks (cuGraphLaunch, cuLaunchKernel): host cost with and without, side by side
        "vgpu-launch": ["make", "-s", "-C", "native/vgpu", "bench"],  # (run in the checkout)
        # (on the real Kubernetes components: it runs the tests' kit, so it lives with the tests)
        "kubernetes": [sys.executable, "tests/kubernetes/kubebench.py"],
        "tenant-planes": [sys.executable, "-m", "tessera.controlplane.benchmarks.planes"],
        # tenants' own API servers running GPU pods on the fleet (the tests' kit too: with the tests)
        "tenant-pods": [sys.executable, "tests/kubernetes/tenantbench.py"],
        # tenants woken from sleep in Kubernetes mode, on a real host control plane (the tests' kit too)
        "tenant-wake-kubernetes": [sys.executable, "tests/controlplane/wakebench.py"],
    }

    def command(name: str, rest: list[str]) -> list[str]:
        if name in ("kubernetes", "tenant-pods", "tenant-wake-kubernetes"):
            return [sys.executable, str(checkout.require(f"tessera bench {name}") / targets[name][1]), *rest]
        if name in ("placement", "placement-speed", "placement-families", "placement-dynamic") and "--nodes" not in rest:
            openb = openb_dir()
            if not openb.exists():
                raise CliError(f"the openb trace is not at {openb}: pass --nodes/--pods or set TESSERA_OPENB_DIR")
            rest = ["--nodes", str(openb / "openb_node_list_gpu_node.csv"),
                    "--pods", str(openb / "openb_pod_list_default.csv"), *rest]
        if name == "vgpu-launch":
            return ["make", "-s", "-C", str(checkout.require("tessera bench vgpu-launch") / "native" / "vgpu"), "bench", *rest]
        return targets[name] + rest

    if args.what == "all":
        code = 0
        for name in ("placement", "placement-families", "placement-speed", "placement-nats", "tenants", "vgpu-launch",
                     "tenant-planes", "kubernetes", "tenant-pods"):
            err.print(f"[bold]== bench {name}[/]")
            # (the service with its compiled core against the Python engine, side by side)
            rest = ["--models", "default,python-core"] if name == "placement-nats" else []
            if name == "placement-families":  # (the families table is kept in the repository)
                rest = ["--md", str(checkout.require("tessera bench all") / "bench" / "placement_families.md")]
            if name == "tenant-planes":  # (and the tenant control planes' table)
                rest = ["--md", str(checkout.require("tessera bench all") / "bench" / "tenant_control_planes.md")]
            code |= subprocess.call(command(name, rest))
        return code
    if args.what not in targets:
        raise CliError(f"unknown benchmark {args.what!r}; choose one of: all, {', '.join(targets)}")
    return subprocess.call(command(args.what, args.rest))
