"""Each service's Dockerfile installs that service, runs its console script, and can be built.

Nothing builds the images here (no Docker engine), so what can drift is checked against the
source: the ENTRYPOINT against pyproject.toml's console scripts, the COPY sources against the
tree and .dockerignore, ENV against the variables the code reads, and the enforcer's libvgpu.so
path against the variable that hands it to workloads.
"""

from __future__ import annotations

import fnmatch
import json

import pytest

from deploy_sources import ROOT, SERVICES, Dockerfile, console_scripts, unread_env


def _dockerfile(service: str) -> Dockerfile:
    return Dockerfile.read(ROOT / "services" / service / "Dockerfile")


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str) -> bool:
    for pattern in _dockerignore():
        bare = pattern.removeprefix("**/")
        for i in range(len(path.split("/"))):
            prefix = "/".join(path.split("/")[: i + 1])
            if fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(prefix.split("/")[-1], bare):
                return True
    return False


@pytest.mark.parametrize("service", SERVICES)
def test_entrypoint_is_the_services_console_script(service):
    (entrypoint,) = _dockerfile(service).all("ENTRYPOINT")
    argv = json.loads(entrypoint)  # exec form: signals reach the service, not a shell
    scripts = console_scripts(ROOT / "services" / service)
    assert argv == [f"tessera-{service}"]
    assert argv[0] in scripts, f"{argv[0]} is not a console script of services/{service}/pyproject.toml"


@pytest.mark.parametrize("service", SERVICES)
def test_image_is_multi_stage_slim_python_311_and_non_root(service):
    df = _dockerfile(service)
    stages = df.stages()
    assert len(stages) >= 2
    bases = {args.split()[0] for args in df.all("FROM")}
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in df.all("ARG") if "=" in a}
    resolved = {args.get(b.strip("${}"), b) for b in bases if not b.startswith(("build", "native"))}
    assert all(b.startswith("python:3.11-slim") for b in resolved), resolved
    (user,) = [a for w, a in stages[-1] if w == "USER"]
    assert user.split(":")[0] not in ("0", "root"), "the final stage must run as an unprivileged user"
    assert user.split(":")[0].isdigit(), "numeric, so that Kubernetes' runAsNonRoot can verify it"


@pytest.mark.parametrize("service", SERVICES)
def test_image_installs_shared_and_the_service_with_their_pins(service):
    df = _dockerfile(service)
    copied = [a.split()[-2] for a in df.all("COPY") if not a.startswith("--from")]
    assert "libs/shared" in copied and f"services/{service}" in copied
    install = " ".join(a for a in df.all("RUN") if "pip install" in a and "/src/" in a)
    assert "/src/libs/shared" in install and f"/src/services/{service}" in install
    assert " -e " not in install, "editable installs would point into the build stage"


@pytest.mark.parametrize("service", SERVICES)
def test_copied_sources_exist_and_are_not_dockerignored(service):
    for args in _dockerfile(service).all("COPY"):
        if args.startswith("--from"):
            continue
        source = args.split()[-2]
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        assert not _ignored(source), f"COPY {source}: excluded by .dockerignore"


def test_dockerignore_keeps_host_build_output_out():
    for path in (".venv", "native/vgpu/build", "services/enforcer/src/tessera_enforcer.egg-info", ".git"):
        assert _ignored(path), f"{path} would be sent into the build context"


@pytest.mark.parametrize("service", SERVICES)
def test_image_healthcheck_asks_healthz_on_the_probe_port(service):
    df = _dockerfile(service)
    (check,) = df.all("HEALTHCHECK")
    assert "/healthz" in check
    env = df.env()
    assert env["TESSERA_HTTP_PORT"] == "8080" and env["TESSERA_HTTP_HOST"] == "0.0.0.0"
    assert "8080" in df.all("EXPOSE")


@pytest.mark.parametrize("service", SERVICES)
def test_image_sets_only_variables_its_code_reads(service):
    env = _dockerfile(service).env()
    assert not unread_env(service, env), f"tessera-{service} never reads: {unread_env(service, env)}"


def test_enforcer_image_builds_and_ships_libvgpu():
    df = _dockerfile("enforcer")
    assert any("make -C /src/native/vgpu" in a for a in df.all("RUN"))
    assert any(a.split()[-2] == "native/vgpu" for a in df.all("COPY") if not a.startswith("--from"))
    shipped = [a.split()[-1] for a in df.all("COPY") if a.startswith("--from=native") and "libvgpu.so" in a]
    assert shipped == [df.env()["TESSERA_LIBVGPU"]]
