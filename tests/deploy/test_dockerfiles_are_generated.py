"""The five service Dockerfiles are what their one template writes (deploy/images/dockerfiles.py),
and they are the files compose.yaml and `make images` build: a hand edit to a generated file, or a
template change not written out, fails here instead of drifting between near-copies."""

from __future__ import annotations

import shutil
import subprocess
import sys

from deploy_sources import ROOT, SERVICES, compose

sys.path.insert(0, str(ROOT / "deploy" / "images"))
sys.path.insert(0, str(ROOT / "deploy" / "podman"))
import dockerfiles  # noqa: E402
import images  # noqa: E402


def test_every_service_dockerfile_is_what_the_template_writes():
    assert {image.service for image in dockerfiles.IMAGES} == set(SERVICES)
    assert dockerfiles.stale() == [], "run 'make dockerfiles'"


def test_the_check_names_a_dockerfile_edited_by_hand(tmp_path):
    for image in dockerfiles.IMAGES:
        copy = image.path(tmp_path)
        copy.parent.mkdir(parents=True)
        shutil.copy(image.path(), copy)
    assert dockerfiles.stale(tmp_path) == []
    edited = tmp_path / "services" / "translator" / "Dockerfile"
    edited.write_text(edited.read_text().replace("USER 10001:10001", "USER 0:0"))
    assert dockerfiles.stale(tmp_path) == [edited]


def test_the_check_command_says_current():
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "images" / "dockerfiles.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_compose_and_make_images_build_the_generated_files():
    generated = {image.service: image.path().relative_to(ROOT).as_posix() for image in dockerfiles.IMAGES}
    built = {name: svc["build"]["dockerfile"] for name, svc in compose()["services"].items() if "build" in svc}
    assert set(built.values()) == set(generated.values())
    assert set(images.service_images()) == set(generated)
