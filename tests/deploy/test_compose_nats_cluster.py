"""The compose set's NATS cluster configs and its Prometheus config are valid and say what they must.

No container engine runs the compose set in these tests, so each member's config is checked by the
pinned nats-server itself (``nats-server -t``) against an authorization directory written the way
`tessera nats-auth` writes it; then the configs are started for real, on loopback, as a cluster
(file storage, `sync_interval: always`, the platform's users), and a service's identity lays out R3
streams on it. Prometheus' config is parsed, checked by Debian's ``promtool`` where it is
installed, and must list every Tessera service of the compose file.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from deploy_sources import ROOT, compose

from tessera.shared import identities, subjects
from tessera.shared.bus import Bus
from tessera.shared.natsserver import NatsServer, find_binary, free_port
from tessera.shared.settings import BusSettings

COMPOSE_DIR = ROOT / "deploy" / "compose"
MEMBERS = ("nats-1", "nats-2", "nats-3")
PROMETHEUS = COMPOSE_DIR / "prometheus" / "prometheus.yml"


def _auth(tmp_path):
    auth = tmp_path / "etc" / "auth"
    passwords = identities.write_auth_dir(auth, ["h100-0"])
    return auth, passwords


@pytest.mark.parametrize("name", MEMBERS)
def test_each_member_config_is_valid_for_the_pinned_nats_server(name, tmp_path):
    _auth(tmp_path)
    config = tmp_path / "etc" / f"{name}.conf"
    shutil.copy(COMPOSE_DIR / "nats" / f"{name}.conf", config)
    done = subprocess.run([find_binary(), "-t", "-c", str(config)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is valid" in done.stdout + done.stderr


@pytest.mark.parametrize("name", MEMBERS)
def test_each_member_is_in_one_cluster_with_file_storage_synced_always(name):
    text = (COMPOSE_DIR / "nats" / f"{name}.conf").read_text()
    assert re.search(rf"server_name:\s*{name}\b", text)
    assert re.search(r"sync_interval:\s*always", text)
    assert re.search(r"store_dir:\s*/data", text)
    assert set(re.findall(r"nats-route://(nats-\d):6222", text)) == set(MEMBERS)
    assert 'include "auth/nats.conf"' in text  # the same users and accounts as a single server


async def test_the_member_configs_form_a_working_authenticated_cluster(tmp_path):
    """The three configs as they are, with only the host names and ports moved to loopback."""
    auth, passwords = _auth(tmp_path)
    ports = {m: (free_port(), free_port()) for m in MEMBERS}  # client, route
    servers = []
    for name in MEMBERS:
        text = (COMPOSE_DIR / "nats" / f"{name}.conf").read_text()
        text = text.replace("0.0.0.0:6222", f"127.0.0.1:{ports[name][1]}")
        text = text.replace("0.0.0.0:4222", f"127.0.0.1:{ports[name][0]}").replace("http: 0.0.0.0:8222\n", "")
        for other in MEMBERS:
            text = text.replace(f"nats-route://{other}:6222", f"nats-route://127.0.0.1:{ports[other][1]}")
        text = text.replace("store_dir: /data", "")  # NatsServer passes its own store (-sd)
        config = tmp_path / "etc" / f"{name}.conf"
        config.write_text(text)
        servers.append(NatsServer(tmp_path / name, ports[name][0], config_file=config).start())
    try:
        url = ",".join(f"nats://127.0.0.1:{ports[m][0]}" for m in MEMBERS)
        bus = await Bus.connect(BusSettings(url=url, user="translator", password=passwords["translator"], replicas=3),
                                "translator")
        try:
            await bus.ensure_topology()
            info = await bus.stream_info(subjects.STREAM_CLAIMS)
            assert info.config.num_replicas == 3
            assert (await bus.stream_info(f"KV_{subjects.KV_CLAIMS}")).config.num_replicas == 3
        finally:
            await bus.close()
    finally:
        for server in servers:
            server.stop()


def _jobs() -> dict[str, dict]:
    return {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}


def _scraped_hosts(job: dict) -> set[str]:
    hosts = {t.split(":")[0] for c in job.get("static_configs", []) for t in c["targets"]}
    return hosts | {n for c in job.get("dns_sd_configs", []) for n in c["names"]}


def test_prometheus_scrapes_every_tessera_service_of_the_compose_set():
    services = compose()["services"]
    tessera = {n for n, s in services.items() if "build" in s}
    scraped = set().union(*(_scraped_hosts(job) for job in _jobs().values()))
    assert tessera and tessera <= scraped, f"not scraped: {sorted(tessera - scraped)}"
    for job in _jobs().values():
        for host in _scraped_hosts(job) - {"localhost"}:
            env = services[host]["environment"]
            port = env["TESSERA_METRICS_PORT"]  # the metrics listener, never the probe port
            assert port != env["TESSERA_HTTP_PORT"] and env["TESSERA_METRICS_HOST"] == "0.0.0.0", host
            targets = [t for c in job.get("static_configs", []) for t in c["targets"]]
            ports = {t.split(":")[1] for t in targets if t.startswith(host + ":")}
            ports |= {str(c["port"]) for c in job.get("dns_sd_configs", []) if host in c["names"]}
            assert ports == {port}, f"{job['job_name']} scrapes {host} on {ports}, its metrics are on {port}"
    assert services["prometheus"]["volumes"][0].startswith("./prometheus/prometheus.yml:")


def test_prometheus_config_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed: apt-get install prometheus")
    done = subprocess.run([promtool, "check", "config", str(PROMETHEUS)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
