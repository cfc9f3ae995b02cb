"""Placement throughput and latency end to end through NATS, on the openb fleet and a 5,000-node one.

This measures the placement *service*, not the engine alone: claims are published as ``requested``
on the claims stream and counted when ``allocated`` (or ``unschedulable``) is published, with the
real ledger compare-and-set, claim records and JetStream file storage in between. Each fleet gets a
fresh nats-server and fresh placement process(es); the figures of one run are measured side by side:

  throughput  N claims published as fast as the client can, decisions per second until the last one
  latency     claims published at a fixed rate (default 500/s); p50/p99 from publish to decision
  RSS         peak resident memory (VmHWM) of each placement process holding the fleet
  CPU         CPU time of the placement process(es) per claim in the throughput phase (steadier
              than claims/s where other work shares the machine)

Run: python -m tessera.placement.benchmarks.through_nats [--fleet openb|5000|both] [--claims 4000] [--replicas 1]
     [--repeat 3] [--models default,python-core]  (each fleet and model is measured --repeat times,
     interleaved; the table shows medians: one run moves a lot on a shared box, bench/placement_sim.md)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from statistics import median

import msgspec

from tessera.shared import checkout, subjects
from tessera.shared.bus import Bus, Outgoing
from tessera.shared.claimstore import ClaimStore
from tessera.shared.events import ClaimRecord, ClaimRequested, ClaimSpec, NodeInventory, TenantRecord, encode
from tessera.shared.natsserver import NatsServer, die_with_parent, free_port
from tessera.shared.runner import is_ready
from tessera.shared.settings import BusSettings

from tessera.placement.benchmarks.trace import load_nodes, load_pods, node_inventory


def _openb_dir() -> Path:
    """The openb trace: $TESSERA_OPENB_DIR, else shared/data/openb beside the checkout."""
    if os.environ.get("TESSERA_OPENB_DIR"):
        return Path(os.environ["TESSERA_OPENB_DIR"])
    root = checkout.find()
    return (root.parent if root else Path.cwd()) / "shared" / "data" / "openb"


DEFAULT_DATA = _openb_dir()


def fleet(kind: str, nodes_csv: Path) -> list[NodeInventory]:
    base = [node_inventory(n) for n in load_nodes(nodes_csv)]
    if kind == "openb":
        return base
    size = int(kind)
    out = []
    for i in range(size):
        inv = base[i % len(base)]
        name = f"n{i:05d}"
        devices = [msgspec.structs.replace(d, uuid=f"GPU-{name}-{d.index}") for d in inv.devices]
        out.append(msgspec.structs.replace(inv, node=name, devices=devices))
    return out


def claim_specs(pods_csv: Path, count: int, seed: int) -> list[ClaimSpec]:
    gpu_pods = [p for p in load_pods(pods_csv) if p.num_gpu > 0]
    rng = random.Random(seed)
    specs = []
    for _ in range(count):
        p = rng.choice(gpu_pods)
        if p.gpu_milli >= 1000:
            spec = ClaimSpec(gpus=p.num_gpu, cores=100, memory_percent=100)
        else:
            pct = max(1, min(99, -(-p.gpu_milli // 10)))
            spec = ClaimSpec(gpus=1, memory_percent=pct, cores=pct)
        specs.append(msgspec.structs.replace(spec, use_types=list(p.gpu_spec), cpu_millis=p.cpu_milli,
                                             host_memory_mib=p.memory_mib))
    return specs


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Placement models that can be measured side by side (--models): the service's environment for each.
MODELS: dict[str, dict[str, str]] = {
    "default": {},
    "python-core": {"TESSERA_PLACEMENT_CORE": "python"},
    "no-fluid": {"TESSERA_PLACEMENT_FLUID_MEMORY": "false"},
    "binpack": {"TESSERA_PLACEMENT_POLICY": "binpack"},
    # The default without its work between decisions (indexes warmed ahead, idle GC passes).
    "no-idle-work": {"TESSERA_PLACEMENT_IDLE_WORK": "false"},
    # The default with its metrics listener on, refreshed and scraped every second (a Prometheus at
    # scrape_interval 1s): what observing placement costs it.
    "metrics": {"TESSERA_METRICS_PORT": "auto", "TESSERA_METRICS_INTERVAL": "1"},
}
SCRAPE_SECONDS = 1.0


class Scraper:
    """GETs every placer's /metrics each SCRAPE_SECONDS in a thread, as Prometheus would."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.stop = threading.Event()
        self.scrapes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(SCRAPE_SECONDS):
            for port in self.ports:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                        reply.read()
                        self.scrapes += 1
                except OSError:
                    pass

    def start(self) -> "Scraper":
        if self.ports:
            self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(15)


def start_placers(url: str, replicas: int, workdir: Path,
                  model_env: dict[str, str] | None = None) -> list[tuple[subprocess.Popen, int, int]]:
    """(process, probe port, metrics port or 0) per replica."""
    out = []
    for i in range(replicas):
        port = free_port()
        env = dict(os.environ, TESSERA_NATS_URL=url, TESSERA_HTTP_PORT=str(port), TESSERA_INSTANCE=f"bench-{i}",
                   TESSERA_LOG_LEVEL="WARNING", **(model_env or {}))
        if env.get("TESSERA_METRICS_PORT") == "auto":
            env["TESSERA_METRICS_PORT"] = str(free_port())
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        with open(workdir / f"placement-{i}.log", "wb") as log:  # (the child keeps its own copy)
            proc = subprocess.Popen([str(Path(sys.executable).parent / "tessera-placement")], env=env,
                                    stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        out.append((proc, port, int(env.get("TESSERA_METRICS_PORT") or 0)))
    for proc, port, _ in out:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"placement exited with {proc.returncode}; see {workdir}")
            if is_ready(port, timeout=1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("placement not ready after 120 s")
            time.sleep(0.1)
    return out


async def translated(store: ClaimStore, prefix: str, specs: list[ClaimSpec]) -> list[ClaimRequested]:
    """What the translator does before publishing: record each claim, note the record's revision."""
    events = []
    for chunk in range(0, len(specs), 500):
        part = [ClaimRecord(claim=f"{prefix}{chunk + i:06d}", tenant="bench", state="requested", spec=s)
                for i, s in enumerate(specs[chunk: chunk + 500])]
        revisions = await asyncio.gather(*(store.create(r) for r in part))
        events += [ClaimRequested(claim=r.claim, tenant="bench", spec=r.spec, record_revision=rev or 0)
                   for r, rev in zip(part, revisions)]
    return events


class Decisions:
    """Core-NATS subscriber timing every allocated/unschedulable event by claim id."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.allocated = 0
        self.unschedulable = 0
        self.changed = asyncio.Event()

    async def on_msg(self, msg) -> None:
        _, claim, kind, _ = subjects.claim_subject_parts(msg.subject)
        if claim not in self.at:
            self.at[claim] = time.perf_counter()
            if kind == "allocated":
                self.allocated += 1
            else:
                self.unschedulable += 1
            self.changed.set()


async def wait_for(decisions: Decisions, claims: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(c not in decisions.at for c in claims[-50:]) or sum(c in decisions.at for c in claims) < len(claims):
        if time.monotonic() > deadline:
            missing = sum(c not in decisions.at for c in claims)
            raise RuntimeError(f"{missing} of {len(claims)} claims got no decision in {timeout:.0f}s")
        decisions.changed.clear()
        try:
            await asyncio.wait_for(decisions.changed.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def run_fleet(kind: str, args, progress, model: str = "default") -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"tessera-natsbench-{kind}-"))
    nodes = fleet(kind, args.nodes)
    gpus = sum(len(n.devices) for n in nodes)
    specs = claim_specs(args.pods, args.claims + int(args.rate * args.latency_seconds), args.seed)
    with NatsServer(workdir / "nats") as server:
        bus = await Bus.connect(BusSettings(url=server.url), "bench")
        await bus.ensure_topology()
        inv_kv = await bus.kv(subjects.KV_INVENTORY)
        progress(f"{kind}: loading {len(nodes)} nodes, {gpus} GPUs into the inventory bucket")
        await asyncio.gather(*(inv_kv.put(n.node, encode(n)) for n in nodes))
        await (await bus.kv(subjects.KV_TENANTS)).put("bench", encode(TenantRecord(tenant="bench")))
        progress(f"{kind}: starting {args.replicas} placement process(es)")
        placers = await asyncio.to_thread(start_placers, server.url, args.replicas, workdir, MODELS[model])
        decisions = Decisions()
        subs = [await bus.listen(subjects.claims_of_kind(k), decisions.on_msg)
                for k in ("allocated", "unschedulable")]
        scraper = Scraper([m for *_, m in placers if m]).start()
        try:
            # Throughput: publish everything as fast as the client can, then wait for the last decision.
            store = ClaimStore(await bus.kv(subjects.KV_CLAIMS))
            events = await translated(store, "t", specs[: args.claims])
            progress(f"{kind}: throughput, {len(events)} claims")
            start = time.perf_counter()
            cpu0 = sum(cpu_seconds(p.pid) for p, *_ in placers)
            for chunk in range(0, len(events), 500):
                await bus.publish_many(Outgoing(subjects.claim("bench", e.claim, "requested"), e, f"{e.claim}:requested")
                                       for e in events[chunk: chunk + 500])
            await wait_for(decisions, [e.claim for e in events], timeout=600)
            elapsed = max(decisions.at[e.claim] for e in events) - start
            # CPU the placement process(es) spent per claim: steadier than claims/s on a shared box
            cpu_us = (sum(cpu_seconds(p.pid) for p, *_ in placers) - cpu0) / len(events) * 1e6
            throughput = len(events) / elapsed
            allocated = decisions.allocated

            # Latency at a fixed rate.
            rest = await translated(store, "l", specs[args.claims:])
            progress(f"{kind}: latency at {args.rate:.0f} claims/s for {args.latency_seconds:.0f}s")
            sent: dict[str, float] = {}
            interval = 1.0 / args.rate
            t0 = time.perf_counter()
            for i, e in enumerate(rest):
                due = t0 + i * interval
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent[e.claim] = time.perf_counter()
                await bus.publish_async(subjects.claim("bench", e.claim, "requested"), encode(e),
                                        headers={"Nats-Msg-Id": f"{e.claim}:requested"})
            achieved = len(rest) / (time.perf_counter() - t0)
            await wait_for(decisions, list(sent), timeout=300)
            lat = sorted((decisions.at[c] - t) * 1000 for c, t in sent.items())
            p50 = lat[len(lat) // 2]
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
            rss = [rss_mib(p.pid) for p, *_ in placers]
        finally:
            scraper.close()
            for s in subs:
                await s.unsubscribe()
            for proc, *_ in placers:
                proc.terminate()
            for proc, *_ in placers:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            await bus.close()
    return {
        "fleet": kind, "model": model, "nodes": len(nodes), "gpus": gpus, "replicas": args.replicas,
        "claims": args.claims, "claims_per_s": round(throughput, 1), "allocated": allocated,
        "placement_cpu_us_per_claim": round(cpu_us, 1),
        "latency_rate": round(achieved, 1), "p50_ms": round(p50, 2), "p99_ms": round(p99, 2),
        "rss_mib": [round(r, 1) for r in rss], "scrapes": scraper.scrapes,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tessera bench placement-nats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fleet", default="both", help="openb, a node count like 5000, or both (default)")
    p.add_argument("--nodes", type=Path, default=DEFAULT_DATA / "openb_node_list_gpu_node.csv")
    p.add_argument("--pods", type=Path, default=DEFAULT_DATA / "openb_pod_list_default.csv")
    p.add_argument("--claims", type=int, default=4000, help="claims in the throughput phase")
    p.add_argument("--rate", type=float, default=500.0, help="claims/s in the latency phase")
    p.add_argument("--latency-seconds", type=float, default=4.0)
    p.add_argument("--replicas", type=int, default=1, help="placement processes")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--repeat", type=int, default=3,
                   help="runs per fleet (default 3): the table shows each figure's median, claims/s with its range")
    p.add_argument("--models", default="default",
                   help="comma list of placement models measured side by side, runs interleaved: "
                        + ", ".join(MODELS) + " (python-core: the Python engine instead of the compiled "
                        "core; no-fluid: without the host-memory term; binpack: HAMi's binpack; no-idle-work: the default "
                        "without its indexes warmed ahead and GC passes between decisions; metrics: the "
                        "default with its metrics listener, refreshed and scraped every second)")
    p.add_argument("--json", type=Path, help="also write the results (every run) here")
    args = p.parse_args(argv)
    if args.repeat < 1:
        print("error: --repeat must be at least 1", file=sys.stderr)
        return 2
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        print(f"error: unknown model(s) {', '.join(unknown) or '(none)'}; use a comma list of: {', '.join(MODELS)}",
              file=sys.stderr)
        return 2
    for f in (args.nodes, args.pods):
        if not f.exists():
            print(f"error: {f} not found; pass --nodes/--pods (the openb trace is in shared/data/openb)",
                  file=sys.stderr)
            return 2
    kinds = ["openb", "5000"] if args.fleet == "both" else [args.fleet]

    def progress(msg: str) -> None:
        print(f"• {msg}", file=sys.stderr, flush=True)

    # Interleaved (run 1 of every fleet and model, then run 2, ...), so that a slow spell of a shared
    # machine does not fall on one model alone.
    runs: dict[tuple[str, str], list[dict]] = {}
    for i in range(args.repeat):
        for k in kinds:
            for m in models:
                label = k if len(models) == 1 else f"{k}, {m}"
                progress(f"{label}: run {i + 1} of {args.repeat}")
                runs.setdefault((k, m), []).append(asyncio.run(run_fleet(k, args, progress, m)))
    print(f"\nplacement through NATS ({args.replicas} process(es), JetStream file storage; "
          f"median of {args.repeat} run(s){'; models run interleaved' if len(models) > 1 else ''})")
    print(f"{'fleet':>8} {'model':>12} {'nodes':>6} {'GPUs':>6} {'claims/s':>9} {'(range)':>13} {'ratio':>6} "
          f"{'allocated':>10} {'CPU µs/claim':>12} {'p50 ms':>8} {'p99 ms':>8} {'at rate':>8} {'RSS MiB':>8}")
    for (k, m), rs in runs.items():
        r = rs[0]
        rate = [x["claims_per_s"] for x in rs]
        span = f"{min(rate):.0f}-{max(rate):.0f}"
        first = median(x["claims_per_s"] for x in runs[(k, models[0])])
        print(f"{k:>8} {m:>12} {r['nodes']:>6} {r['gpus']:>6} {median(rate):>9.0f} {span:>13} "
              f"{median(rate) / first:>5.2f}x "
              f"{min(x['allocated'] for x in rs):>5}/{r['claims']:<4} "
              f"{median([x['placement_cpu_us_per_claim'] for x in rs]):>12.0f} "
              f"{median([x['p50_ms'] for x in rs]):>8.1f} {median([x['p99_ms'] for x in rs]):>8.1f} "
              f"{median([x['latency_rate'] for x in rs]):>8.0f} {max(max(x['rss_mib']) for x in rs):>8.1f}")
    if len(models) > 1:
        print(f"(ratio: claims/s against {models[0]} on the same fleet)")
    results = [x for rs in runs.values() for x in rs]
    print("Kubernetes DRA allocator, published: ~51-122 pods/s at 500 nodes, ~8-17 at 5,000.")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
