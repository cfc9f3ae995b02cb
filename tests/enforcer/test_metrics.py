"""The enforcer's /metrics: HAMi's monitor names and labels, and Tessera's allocated-versus-used view,
served on a listener of their own (TESSERA_METRICS_PORT): the probe port, which the kubelet and so
any pod may reach, serves no claim id (issue 13)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from prometheus_client.parser import text_string_to_metric_families

from tessera.cli.client import Client

from kit import eventually
from runkit import MIB, finish, run_claims, start_run


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def scrape(port: int) -> dict[str, list]:
    status, text = get(port, "/metrics")
    assert status == 200, (status, text)
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples, **labels) -> float | None:
    found = [s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items())]
    return found[0] if found else None


async def test_metrics_show_hami_series_and_allocated_versus_used(cluster, tmp_path):
    client = await Client.connect(cluster.url)
    port = cluster.find("enforcer-gpu-0").metrics_port
    try:
        known = set(await run_claims(client))
        proc = await start_run(cluster, "--gpumem", "2000", "--gpucores", "40",
                               workload=["--alloc", "300", "--hold-file", str(tmp_path / "go")])

        async def running():
            fresh = [c for c, s in (await run_claims(client)).items() if c not in known and s == "running"]
            return fresh[0] if fresh else None

        claim = await eventually(running, what="the claim to run")
        record = await client.claim(claim)
        uuid = record.devices[0].uuid

        def used():
            # Metrics come from the enforcer's periodic observation: wait for one that has seen both
            # the workload's allocation and the claim's move to running.
            m = scrape(port)
            seen = value(m.get("hami_vgpu_memory_used_bytes", []), pod=claim) == 300 * MIB
            running_now = value(m.get("tessera_claims", []), node="gpu-0", state="running") == 1
            return m if seen and running_now else None

        m = await eventually(used, what="the metrics to show 300 MiB used by a running claim")
        labels = dict(namespace="alpha", pod=claim, container="workload", vdevice_index="0", device_uuid=uuid, zone="vGPU")
        assert value(m["hami_vgpu_memory_used_bytes"], **labels) == 300 * MIB
        assert value(m["hami_vgpu_memory_limit_bytes"], **labels) == 2000 * MIB
        legacy = dict(podnamespace="alpha", podname=claim, ctrname="workload", vdeviceid="0", deviceuuid=uuid)
        assert value(m["vGPU_device_memory_usage_in_bytes"], **legacy) == 300 * MIB
        assert value(m["vGPU_device_memory_limit_in_bytes"], **legacy) == 2000 * MIB
        assert value(m["hami_host_gpu_memory_used_bytes"], node="gpu-0", device_uuid=uuid) == 300 * MIB
        assert value(m["tessera_gpu_memory_allocated_bytes"], device_uuid=uuid) == 2000 * MIB
        assert value(m["tessera_gpu_memory_used_bytes"], device_uuid=uuid) == 300 * MIB
        assert value(m["tessera_gpu_cores_allocated_ratio"], device_uuid=uuid) == 40
        assert value(m["tessera_claims"], node="gpu-0", state="running") == 1
        assert value(m["tessera_claim_processes"], claim=claim) == 1
        # One of two GPUs carries a slice: all of its free memory is stranded for a whole-GPU request.
        frag = value(m["tessera_node_fragmentation_ratio"], node="gpu-0")
        assert 0 < frag < 1
        assert_probe_port_serves_no_claim(cluster, claim)
        (tmp_path / "go").touch()
        assert (await finish(proc)).code == 0
    finally:
        (tmp_path / "go").touch()  # never leave the workload holding its claim for the next test
        await client.close()


def assert_probe_port_serves_no_claim(cluster, claim: str) -> None:
    """The split, while a claim is running and its series are on the metrics listener: the probe
    port answers its probes and nothing with a claim id; the metrics listener serves only /metrics."""
    enforcer = cluster.find("enforcer-gpu-0")
    assert enforcer.metrics_port and enforcer.metrics_port != enforcer.http_port
    status, body = get(enforcer.http_port, "/metrics")
    assert status == 404 and claim not in body
    for probe in ("/healthz", "/readyz"):
        status, body = get(enforcer.http_port, probe)
        assert status == 200 and claim not in body
        assert get(enforcer.metrics_port, probe)[0] == 404
    assert claim in get(enforcer.metrics_port, "/metrics")[1]


@pytest.mark.parametrize("port", ["65536", "-1", "x"])
def test_a_metrics_port_that_is_no_port_stops_the_service_naming_it(port):
    from tessera.shared.errors import ConfigError
    from tessera.shared.settings import ServiceSettings

    with pytest.raises(ConfigError, match="TESSERA_METRICS_PORT"):
        ServiceSettings.from_env({"TESSERA_METRICS_PORT": port}, service="enforcer")


def test_the_metrics_port_is_never_the_probe_port():
    from tessera.shared.errors import ConfigError
    from tessera.shared.settings import ServiceSettings

    with pytest.raises(ConfigError, match="TESSERA_METRICS_PORT=9394 is the probe port"):
        ServiceSettings.from_env({"TESSERA_METRICS_PORT": "9394", "TESSERA_HTTP_PORT": "9394"}, service="enforcer")


def test_metrics_listen_where_configured_and_not_by_default():
    from tessera.shared.settings import ServiceSettings

    default = ServiceSettings.from_env({}, service="enforcer")
    assert (default.metrics_host, default.metrics_port) == ("127.0.0.1", 0)
    chosen = ServiceSettings.from_env({"TESSERA_METRICS_HOST": "10.0.0.7", "TESSERA_METRICS_PORT": "9394"},
                                      service="enforcer")
    assert (chosen.metrics_host, chosen.metrics_port) == ("10.0.0.7", 9394)
