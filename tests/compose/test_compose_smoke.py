"""The compose set runs for real: a claim submitted from the host is prepared by an enforcer, and
still is with one of the three NATS members stopped.

deploy/compose with compose.local.yaml, under podman-compose (deploy/podman/compose.py, the same
code `make compose-up` runs), on the images `make images` built. From the host, as the NATS
operator on the published client ports of all three members, the tessera CLI creates a tenant and
submits a claim; the claim must reach ``prepared`` (the enforcer's transition) and the chosen
node's enforcer must hold the claim's CDI spec. Then nats-1, the member the host's URL names first
and the one that publishes 4222, is stopped, and a second claim must go the same way through the
two members left. The services' traces must have reached the Jaeger stand-in, and the set's
Prometheus (its query API on the published port) must scrape every Tessera container's metrics
listener, both placement replicas included, and answer Tessera's series: placement's decision
timer counting both claims and, from the enforcer of each claim's node, HAMi's memory-limit series
for that claim. The set is torn down (containers, network, volumes) whatever happens.

Not part of `make test` (building the images takes minutes): `make compose-test` runs it after
`make images`. It fails, never skips, where Podman is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "podman"))
import compose  # noqa: E402
import podmanhost  # noqa: E402

from tessera.enforcer import cdi  # noqa: E402
from tessera.shared import profile  # noqa: E402
from tessera.shared.natsserver import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

TESSERA = Path(sys.executable).parent / "tessera"
NODES = sorted(n.node for n in profile.load(str(ROOT / "profiles" / "demo.yaml")))
STARTUP_S = 420  # on 2 shared cores, a dozen Python services importing at once take minutes
GPUMEM_MIB = 8000  # what each smoke claim asks for
# Prometheus scrapes every 15 s and looks placement's replicas up in DNS every 30 s
# (prometheus/prometheus.yml): a few rounds of both.
SCRAPED_S = 180


def podman(environment, *args, check=True, timeout=120) -> subprocess.CompletedProcess:
    """One podman command, killed with whatever it started when it has not answered in ``timeout``."""
    done = podmanhost.run_bounded(["podman", *args], timeout, env=environment, what=f"podman {' '.join(args)}")
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    return done


def containers(environment, service: str | None = None) -> list[str]:
    args = ["ps", "-a", "--format", "{{.Names}}", "--filter", f"label=io.podman.compose.project={compose.PROJECT}"]
    if service:
        args += ["--filter", f"label=com.docker.compose.service={service}"]
    return podman(environment, *args).stdout.split()


def logs_of(environment, name: str, lines: int = 40) -> str:
    done = podman(environment, "logs", "--tail", str(lines), name, check=False)
    return f"--- {name}\n{done.stdout}{done.stderr}"


@pytest.fixture(scope="module")
def compose_set(tmp_path_factory):
    missing = None
    try:
        environment = compose.env()
    except podmanhost.PodmanMissing as exc:
        missing = str(exc)
    if missing:  # a failure, never a skip: this test exists to run the set
        pytest.fail(f"the compose smoke test cannot run the set here: {missing}", pytrace=False)
    # Free host ports: the defaults (4222, ...) may be taken by a NATS or a set already running here.
    environment.update({variable: str(free_port()) for variable in compose.published_ports()})
    compose.down("-v", environment=environment, capture=True, timeout=300)  # an earlier run's
    try:
        failed = None
        try:
            compose.up(environment, timeout=compose.UP_TIMEOUT_S)
        except (podmanhost.PodmanMissing, podmanhost.Overran, compose.ComposeFailed) as exc:
            failed = str(exc)  # an image is not built, or a container did not start: its name and podman's reason
        if failed:
            pytest.fail(failed, pytrace=False)
        yield environment
    finally:
        # Every container's log, kept for a failure's post-mortem (the set itself goes away now).
        logs = tmp_path_factory.mktemp("compose-logs")
        for name in containers(environment):
            (logs / f"{name}.log").write_text(logs_of(environment, name, lines=2000))
        print(f"compose set's logs: {logs}")
        compose.down("-v", "-t", "10", environment=environment, capture=True, timeout=300)
        left = containers(environment)
        assert not left, f"podman-compose down left containers behind: {left}"


def cli(environment, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, TESSERA_NATS_URL=compose.host_nats_url(environment), TESSERA_NATS_USER="operator",
               TESSERA_NATS_PASSWORD_FILE=str(compose.AUTH_DIR / "passwords" / "operator"))
    return podmanhost.run_bounded([str(TESSERA), *args], timeout, env=env)


def wait_healthy(environment) -> None:
    """Every container with a healthcheck passes it (Tessera's: /readyz). Podman without systemd runs
    no healthcheck timers, so the checks are run here, by `podman healthcheck run`."""
    deadline = time.monotonic() + STARTUP_S
    checked = {name: svc.get("deploy", {}).get("replicas", 1) for name, svc in compose.services().items()
               if "healthcheck" in svc}
    pending = [n for service in checked for n in containers(environment, service)]
    assert len(pending) == sum(checked.values()), f"not every service has its containers: {pending}"
    while pending and time.monotonic() < deadline:
        pending = [n for n in pending if podman(environment, "healthcheck", "run", n, check=False).returncode != 0]
        if pending:
            time.sleep(5)
    assert not pending, "not healthy in time: " + ", ".join(pending) + "\n" + compose.describe(
        c for c in compose.container_states(environment) if c["Name"] in pending) + "\n" + "\n".join(
        logs_of(environment, n) for n in pending)


def until(what: str, attempt, timeout: float):
    """Runs ``attempt`` until it returns something true or ``timeout`` passes; the last result fails."""
    deadline = time.monotonic() + timeout
    while True:
        result, done = attempt()
        if done or time.monotonic() > deadline:
            assert done, f"{what}: {result}"
            return result
        time.sleep(3)


def submit_prepared(environment, label: str) -> dict:
    """One claim, submitted until Tessera answers (an unavailable bus is retried with the same claim
    id, which makes the retry idempotent); it must end prepared, with its CDI spec on its node."""
    claim = f"smoke-{label}-{uuid.uuid4().hex[:8]}"

    def attempt():
        done = cli(environment, "submit", "--tenant", "team-a", "--gpumem", str(GPUMEM_MIB), "--claim", claim, "--wait",
                   "--timeout", "60", "-o", "json", timeout=120)
        return done, done.returncode not in (4, 5)  # unavailable, or the wait ran out: again

    done = until(f"submitting {claim}", attempt, 300)
    assert done.returncode == 0, f"submit {claim}: exit {done.returncode}\n{done.stdout}{done.stderr}"
    record = json.loads(done.stdout)
    assert record["claim"] == claim and record["state"] in ("prepared", "running"), record
    assert record["node"] in NODES and record["devices"], record
    (enforcer,) = containers(environment, f"enforcer-{record['node']}")
    spec = cdi.spec_path("/var/run/cdi", claim)
    listed = podman(environment, "exec", enforcer, "ls", str(spec.parent)).stdout.split()
    assert spec.name in listed, f"{enforcer} has no CDI spec {spec.name} for {claim}: {listed}"
    return record


def test_a_claim_is_prepared_before_and_after_a_nats_member_stops(compose_set):
    environment = compose_set
    wait_healthy(environment)

    def create_tenant():
        done = cli(environment, "tenant", "create", "team-a", "--gpus", "8")
        return done, done.returncode == 0

    until("creating tenant team-a", create_tenant, 120)

    def fleet_published():
        done = cli(environment, "status", "-o", "json")
        nodes = json.loads(done.stdout)["totals"]["nodes"] if done.returncode == 0 else None
        return (done.returncode, nodes, done.stderr[-500:]), nodes == len(NODES)

    until("waiting for capacity to publish every demo node", fleet_published, 120)

    claims = [submit_prepared(environment, "all-members")]

    (member,) = containers(environment, "nats-1")
    podman(environment, "stop", "-t", "5", member)
    state = podman(environment, "inspect", "--format", "{{.State.Status}}", member).stdout.strip()
    assert state in ("exited", "stopped"), f"{member} is {state} after podman stop"

    claims.append(submit_prepared(environment, "one-member-down"))

    def traces_received():
        port = compose.host_port(environment, "TESSERA_COMPOSE_JAEGER_UI_PORT")  # the stand-in's counts
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as reply:
            counts = json.load(reply)
        return counts, counts["exports"] > 0

    until("the services' OTLP exports reaching the Jaeger stand-in", traces_received, 60)

    prometheus_scrapes_every_service_and_the_claims(environment, claims)


def prometheus_api(environment, path: str, **params: str) -> object:
    """One call of the compose Prometheus' HTTP API on its published port; its ``data``."""
    port = compose.host_port(environment, "TESSERA_COMPOSE_PROMETHEUS_PORT")
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}{query}", timeout=10) as reply:
        answer = json.load(reply)
    assert answer["status"] == "success", answer
    return answer["data"]


def instant(environment, promql: str) -> list[dict]:
    """An instant query's vector: [{"metric": {labels}, "value": [ts, "text"]}, ...]."""
    return prometheus_api(environment, "query", query=promql)["result"]


def prometheus_scrapes_every_service_and_the_claims(environment, claims: list[dict]) -> None:
    # Every Tessera container serves metrics (TESSERA_METRICS_PORT in its environment), once per replica.
    expected = {name: svc.get("deploy", {}).get("replicas", 1) for name, svc in compose.services().items()
                if "TESSERA_METRICS_PORT" in svc.get("environment", {})}
    names = {}  # container address -> name, for placement's replicas, which DNS discovery lists by address
    for service in expected:
        for name in containers(environment, service):
            inspected = podman(environment, "inspect", "--format",
                               "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}", name).stdout.split()
            names.update({address: name for address in inspected})

    def every_target_up():
        try:
            up = instant(environment, 'up{job!="prometheus"}')
            targets = prometheus_api(environment, "targets", state="active")["activeTargets"]
        except OSError as exc:  # Prometheus not listening yet
            return f"Prometheus' API: {exc!r}", False
        errors = {(t["labels"]["job"], t["labels"]["instance"]): t.get("lastError", "") for t in targets}
        down = []
        per_job: dict[str, int] = {}
        for sample in up:
            job, instance = sample["metric"]["job"], sample["metric"]["instance"]
            per_job[job] = per_job.get(job, 0) + 1
            if sample["value"][1] != "1":
                address = instance.rsplit(":", 1)[0]
                shown = f"{job} {instance}" + (f" ({names[address]})" if address in names else "")
                down.append(f"{shown}: up={sample['value'][1]} {errors.get((job, instance), '')}".strip())
        seen = len(up)
        placement = per_job.get("placement", 0)
        report = (f"{seen} of {sum(expected.values())} Tessera targets scraped ({per_job}), "
                  f"placement replicas scraped: {placement} of {expected['placement']}; "
                  f"not up: {down or 'none'}")
        return report, not down and seen == sum(expected.values()) and placement == expected["placement"]

    print(until("the compose Prometheus scraping every Tessera target", every_target_up, SCRAPED_S))

    def decisions_counted():
        result = instant(environment, "sum(tessera_placement_decision_seconds_count)")
        decided = float(result[0]["value"][1]) if result else 0.0
        return f"placement decisions counted: {decided} (sum(tessera_placement_decision_seconds_count))", \
            decided >= len(claims)

    print(until("placement's decision timer in Prometheus", decisions_counted, SCRAPED_S))

    for record in claims:
        claim, node = record["claim"], record["node"]

        def claim_series(claim=claim, node=node):
            result = instant(environment, f'hami_vgpu_memory_limit_bytes{{pod="{claim}"}}')
            series = [(s["metric"].get("job"), s["metric"].get("instance"), s["metric"].get("namespace"),
                       float(s["value"][1])) for s in result]
            return series, series == [("enforcer", f"enforcer-{node}:9394", "team-a", GPUMEM_MIB * 2**20)]

        print(claim, until(f"the enforcer of {node}'s HAMi series for {claim} in Prometheus", claim_series,
                           SCRAPED_S))
