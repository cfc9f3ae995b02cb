"""No tenant secret leaks into logs, events or spans.

The whole system runs (`tessera up`'s processes, tracing to an OTLP receiver over the real
protocol); tenants are created, one runs a claim through every service, one is deleted, a request
is malformed on purpose. Then everything the system let out is collected: every service's log
file, every message on every stream of the platform account (events, the DLQ, the KV streams), and
every OTLP request as received; none may contain any tenant's CA or leaf private key, datastore
password or kubeconfig key, nor any NATS user's password. The scan is shown able to fail: the same
collection with one planted log line is caught.
"""

from __future__ import annotations

import asyncio

from tessera.cli.client import Client
from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota

from secretscan import Haystack, needles, stream_messages, tenant_secrets

from kit import eventually


async def dead_lettered(bus) -> int:
    return (await bus.stream_info(subjects.STREAM_DLQ)).state.messages


async def test_no_secret_appears_in_logs_events_or_spans(start_cluster, otlp_collector):
    cluster = await start_cluster("tiny.yaml", otlp_endpoint=otlp_collector.endpoint)
    operator = await Client.connect(cluster.url)
    secrets: dict[str, bytes] = {}
    try:
        for name in ("alpha", "beta", "gamma"):
            reply = await operator.call(f"{subjects.API_TENANTS}.create",
                                        api.TenantRequest(name=name, quota=GpuQuota(gpus=2)), timeout=30)
            assert reply["phase"] == "Ready", reply
            secrets.update(needles(await tenant_secrets(cluster, operator.bus, name)))
        claim = (await operator.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": 1000})))["claim"]
        await operator.wait_for(claim, {"prepared"}, timeout=60)
        await operator.release(claim)
        await operator.wait_for(claim, {"released"}, timeout=60)
        await operator.call(f"{subjects.API_TENANTS}.delete", api.TenantRequest(name="gamma"), timeout=30)
        await operator.bus.request(f"{subjects.API_TENANTS}.create", b"{not json", timeout=10)  # a refusal path
        await operator.bus.send(subjects.claim("alpha", "bogus", "requested"), b"\xff not a claim")  # to the DLQ
        await operator.bus.flush()
        await eventually(lambda: dead_lettered(operator.bus), what="the bad claim event dead-lettered")
        assert len(secrets) > 3 * 10  # every tenant's keys, password and kubeconfig are looked for
        messages = await stream_messages(operator.bus)
    finally:
        await operator.close()
    secrets.update({f"NATS password of {user}": pw.encode() for user, pw in cluster.passwords.items()})

    for sp in cluster.processes:  # stopping flushes every service's pending spans
        assert await asyncio.to_thread(cluster.stop_process, sp) == 0, sp.name
    logs = {f"log {sp.name}": sp.log_path.read_bytes() for sp in cluster.processes}
    with otlp_collector.lock:
        spans = {f"OTLP request {i}": body for i, body in enumerate(otlp_collector.bodies)}
    assert spans and any(b"tessera-controlplane" in body for body in spans.values()), "no span came from the manager"
    assert any(b"alpha" in blob for blob in logs.values())
    assert any("TESSERA_TENANTS" in where for where in messages) and any("TESSERA_DLQ" in w for w in messages)

    everything = Haystack({**logs, **messages, **spans})
    assert everything.findings(secrets) == []

    # The scan can fail: one log line with one secret in it, as a careless `log.info` would write.
    label, planted = next(iter(secrets.items()))
    careless = dict(logs)
    careless["log controlplane"] = logs["log controlplane"] + b"INFO tenant alpha: " + planted + b"\n"
    assert Haystack(careless).findings(secrets) == [f"{label} in log controlplane"]
