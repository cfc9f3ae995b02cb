"""A real Prometheus scraping a running Tessera answers the questions an operator asks, in PromQL.

The system is the one `tessera up` starts (an embedded nats-server with authorization, each service
its own process, the tiny profile: two nodes of two H100s), every service with a metrics listener of
its own; Debian's Prometheus scrapes them each second. The workload: one tenant with a quota, three
shared claims that fit, one that fits no node, one request the translator refuses, and one payload
that is no event at all. Every check waits on what Prometheus answers, never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import msgspec
import nats
import pytest

from tessera.cli.client import Client
from tessera.cli.cluster import LocalCluster
from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota

from promkit import Prometheus, metric_names, scrape_config

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "tests" / "profiles"
DASHBOARD = ROOT / "deploy" / "grafana" / "tessera.json"
SHARED = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 20000, "nvidia.com/gpucores": 30}


async def _workload(url: str) -> dict:
    client = await Client.connect(url)
    try:
        await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name="alpha", quota=GpuQuota(gpus=8)),
                          timeout=30)
        placed = [(await client.submit(api.SubmitRequest(tenant="alpha", resources=SHARED)))["claim"]
                  for _ in range(3)]
        for claim in placed:
            await client.wait_for(claim, {"prepared", "running"}, timeout=60)
        # Three GPUs on one claim: no node has more than two.
        waiting = (await client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpu": 3})))["claim"]
        await client.wait_for(waiting, {"unschedulable"}, timeout=60)
        bad = api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpu": 1, "nvidia.com/gpucores": 150})
        refused = api.decode_reply(await client.bus.request(subjects.API_SUBMIT, msgspec.json.encode(bad), timeout=10))
    finally:
        await client.close()
    # Not an event: placement dead-letters it (tessera.dlq.placement).
    nc = await nats.connect(url)
    try:
        await nc.jetstream().publish(subjects.claim("alpha", "garbage", "requested", subjects.NO_NODE), b"not json")
    finally:
        await nc.close()
    return {"placed": placed, "waiting": waiting, "refused": refused}


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    """(cluster, prometheus, what was submitted), for the whole module."""
    workdir = tmp_path_factory.mktemp("metrics")
    cluster = LocalCluster(workdir=workdir / "tessera", profile=PROFILES / "tiny.yaml",
                           extra_env={"TESSERA_METRICS_INTERVAL": "0.5"})
    prometheus = None
    try:
        cluster.start()
        cluster.wait_ready(90)
        prometheus = Prometheus(workdir / "prometheus", scrape_config(cluster)).start()
        # Scraped once before anything happens, so that rates see the workload as an increase.
        prometheus.wait("sum(tessera_placement_decision_seconds_count)", lambda r: bool(r), "a first scrape")
        submitted = asyncio.run(_workload(cluster.url))
        yield cluster, prometheus, submitted
    finally:
        if prometheus is not None:
            prometheus.stop()
        cluster.stop(timeout=5)


def values(result: dict) -> list[float]:
    return sorted(result.values())


def test_every_service_process_is_a_target_that_is_up(system):
    cluster, prom, _ = system
    jobs = prom.wait("count by (job) (up == 1)", lambda r: sum(r.values()) == len(cluster.processes),
                     "every process scraped")
    assert {dict(k)["job"] for k in jobs} == {"controlplane", "capacity", "translator", "placement", "enforcer"}


def test_claims_by_state_count_what_was_submitted(system):
    _, prom, _ = system
    prom.wait('sum(tessera_claims_by_state{tenant="alpha", state=~"prepared|running"})',
              lambda r: values(r) == [3.0], "three claims on a node")
    prom.wait('tessera_claims_by_state{tenant="alpha", state="unschedulable"}',
              lambda r: values(r) == [1.0], "the claim that fits no node, waiting")
    prom.wait("tessera_placement_claims_waiting", lambda r: values(r) == [1.0], "placement holding it for a retry")
    prom.wait('sum(tessera_claims{state=~"prepared|running"})', lambda r: values(r) == [3.0],
              "the enforcers' own count of what their nodes hold")


def test_the_decision_latency_histogram_answers_quantiles(system):
    _, prom, _ = system
    prom.wait('sum(tessera_placement_claims_total{outcome="allocated"})', lambda r: values(r) == [3.0],
              "three allocations counted")
    for q in (0.5, 0.99):
        result = prom.wait(
            f"histogram_quantile({q}, sum by (le) (rate(tessera_placement_decision_seconds_bucket[1m])))",
            lambda r: len(r) == 1 and 0 < values(r)[0] < 10, f"a p{int(q * 100)} decision time")
        assert values(result)[0] > 0
    prom.wait("histogram_quantile(0.99, sum by (le) (tessera_placement_claim_latency_seconds_bucket))",
              lambda r: len(r) == 1 and 0 < values(r)[0] < 60, "a p99 request-to-allocation time")


def test_fragmentation_per_node_and_for_the_fleet(system):
    _, prom, _ = system
    # Slices on the GPUs: some free capacity is unusable by a claim of the mix, on some node.
    per_node = prom.wait("max by (node) (tessera_fragmentation_gpu_units)",
                         lambda r: len(r) == 2 and max(r.values()) > 0, "a fragmented node")
    fleet = prom.wait("max(tessera_fleet_fragmentation_gpu_units)", lambda r: len(r) == 1, "the fleet's figure")
    assert values(fleet)[0] == pytest.approx(sum(per_node.values()))
    ratio = prom.query("max(tessera_fleet_fragmentation_ratio)")
    assert 0 < values(ratio)[0] < 1


def test_consumer_lag_and_dead_letters(system):
    _, prom, _ = system
    lag = prom.wait('tessera_consumer_pending_messages{job=~"placement|enforcer"}',
                    lambda r: r and all(v == 0 for v in r.values()) and len(r) >= 3,
                    "placement's and both enforcers' consumers caught up")
    assert {dict(k)["consumer"] for k in lag} >= {"placement"}
    prom.wait('tessera_dlq_messages{service="placement"}', lambda r: values(r) == [1.0],
              "the payload that is no event, dead-lettered")


def test_translator_counts_translated_and_refused_requests(system):
    _, prom, submitted = system
    assert submitted["refused"].ok is False
    prom.wait('tessera_translator_claims_total{source="api", outcome="translated"}', lambda r: values(r) == [4.0],
              "four requests translated")
    prom.wait('tessera_translator_claims_total{source="api", outcome="rejected"}', lambda r: values(r) == [1.0],
              "the 150% cores request refused")


def test_tenants_and_their_quota_use(system):
    _, prom, _ = system
    prom.wait('tessera_tenants{phase="Ready"}', lambda r: values(r) == [1.0], "one tenant ready")
    prom.wait('tessera_tenant_quota_used{tenant="alpha", resource="gpus"}', lambda r: values(r) == [3.0],
              "three GPUs' shares held")
    prom.wait('tessera_tenant_quota_limit{tenant="alpha", resource="gpus"}', lambda r: values(r) == [8.0],
              "its quota")
    assert prom.query('tessera_tenant_quota_limit{tenant="alpha", resource="cores"}') == {}  # no limit there


def test_hami_scheduler_series_for_existing_dashboards(system):
    _, prom, _ = system
    limits = prom.wait('max by (nodeid, deviceuuid) (GPUDeviceMemoryLimit{zone="vGPU"})',
                       lambda r: len(r) == 4, "four GPUs in HAMi's legacy names")
    assert set(values(limits)) == {81559 * 1024 * 1024}
    prom.wait("sum(max by (node, device_uuid) (hami_gpu_shared_count))", lambda r: values(r) == [3.0],
              "three claims sharing GPUs")
    prom.wait("sum(max by (nodeid, deviceuuid) (GPUDeviceSharedNum))", lambda r: values(r) == [3.0],
              "the same in the legacy name")
    prom.wait("sum(max by (node, device_uuid) (hami_gpu_memory_allocated_bytes))",
              lambda r: values(r) == [3 * 20000 * 1024 * 1024], "their memory")
    prom.wait('max(QuotaUsed{quotanamespace="alpha", quotaName="nvidia.com/gpu", limit="8"})',
              lambda r: values(r) == [3.0], "HAMi's quota series")
    prom.wait('count(vGPUMemoryAllocated{podnamespace="alpha"})', lambda r: values(r) == [3.0],
              "one per claim and GPU")


def test_every_dashboard_expression_refers_only_to_exposed_metrics(system):
    _, prom, _ = system
    # The series that exist once the scrapes above have seen the workload.
    prom.wait("count(tessera_fleet_fragmentation_gpu_units)", lambda r: bool(r), "a full scrape")
    prom.wait('count(tessera_dlq_messages{service="placement"})', lambda r: bool(r), "the DLQ series")
    exposed = prom.names()
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    for variable in board["templating"]["list"]:  # label_values(metric, label)
        metric = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["query"]["query"]).group(1)
        assert metric in exposed, f"variable {variable['name']} reads {metric}, which nothing exposes"
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exposed, f"{expr!r} names {sorted(names - exposed)}, which nothing exposes"
        # ... and Prometheus accepts the expression as the dashboard sends it.
        prom.query(expr.replace("$__rate_interval", "1m"))


def test_every_exposed_series_is_documented(system):
    _, prom, _ = system
    prom.wait("count(tessera_fleet_fragmentation_gpu_units)", lambda r: bool(r), "a full scrape")
    doc = (ROOT / "docs" / "metrics.md").read_text()
    ours = {n for n in prom.names() if not n.startswith(("process_", "python_", "scrape_", "up", "go_",
                                                         "prometheus_", "net_conntrack", "promhttp_"))}

    def documented(name: str) -> bool:
        """Listed as itself, or as the family a histogram's or counter's series belongs to."""
        bases = {name} | {name.removesuffix(sfx) for sfx in ("_bucket", "_sum", "_count", "_created", "_total")}
        bases |= {b + "_total" for b in bases}
        return any(f"`{b}`" in doc for b in bases)

    undocumented = sorted(n for n in ours if not documented(n))
    assert not undocumented, f"docs/metrics.md does not list: {undocumented}"


def test_metric_names_of_an_expression():
    assert metric_names('sum by (state) (tessera_claims_by_state{tenant=~"$tenant"})') == {"tessera_claims_by_state"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(tessera_placement_decision_seconds_bucket"
                        "[$__rate_interval])))") == {"tessera_placement_decision_seconds_bucket"}
    assert metric_names("a / on (node) group_left b > 1e3") == {"a", "b"}
