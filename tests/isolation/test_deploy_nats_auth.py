"""deploy/k8s/nats.yaml's authorization is the one `tessera.shared.identities` describes.

The platform account there is generated text; this checks it is what the identities table renders
now (a new subject or bucket cannot be forgotten there), that nats-server accepts the whole config
with the passwords in its environment and a tenant account the manager would write included, and
that each service's Secret names the user the config gives it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from tessera.shared import identities
from tessera.shared.natsserver import find_binary

from tessera.controlplane.datastores.natskv import UsersFile

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def nats_config() -> dict[str, str]:
    return next(d for d in documents("nats.yaml") if d["kind"] == "ConfigMap")["data"]


def service_secrets() -> dict[str, dict]:
    return {d["metadata"]["name"]: d["stringData"] for d in documents("config.yaml") if d["kind"] == "Secret"}


def test_the_k8s_platform_account_is_the_generated_one():
    assert nats_config()["platform.conf"] == identities.k8s_platform_account(), (
        "deploy/k8s/nats.yaml's platform.conf is stale: run 'tessera nats-auth --k8s'")


def test_each_service_secret_names_its_own_user_with_its_password():
    secrets = service_secrets()
    for service in (*identities.SERVICES, identities.VIEWER):
        secret = secrets[f"tessera-nats-{service}"]
        url = urlsplit(secret["url"])
        assert (url.username, url.password) == (service, secret["password"])
    workloads = {"capacity.yaml": "capacity", "translator.yaml": "translator", "placement.yaml": "placement",
                 "enforcer.yaml": "enforcer", "controlplane/manager.yaml": "controlplane"}
    for file, service in workloads.items():
        assert f"secretKeyRef: {{name: tessera-nats-{service}, key: url}}" in (K8S / file).read_text(), file


def test_nats_server_accepts_the_k8s_config_with_a_tenant_account_included(tmp_path):
    config = nats_config()
    users = next(d for d in documents("nats.yaml") if d["kind"] == "Secret")["stringData"]["users.conf"]
    assert UsersFile(tmp_path / "x", None).parse(users) == {}  # it starts with no tenant
    (tmp_path / "conf").mkdir()
    (tmp_path / "nats-users").mkdir()
    UsersFile(tmp_path / "nats-users" / "users.conf", None).write(
        {"alpha": identities.tenant_account("alpha", identities.hash_password("secret"))})
    (tmp_path / "conf" / "platform.conf").write_text(config["platform.conf"])
    conf = tmp_path / "conf" / "nats.conf"
    conf.write_text(config["nats.conf"].replace("/data", str(tmp_path / "data")))
    secrets = service_secrets()
    env = dict(os.environ, POD_NAME="nats-0")
    env[identities.password_env(identities.OPERATOR)] = secrets["tessera-nats"]["password"]
    for user in (*identities.SERVICES, identities.VIEWER):
        env[identities.password_env(user)] = secrets[f"tessera-nats-{user}"]["password"]
    checked = subprocess.run([find_binary(), "-c", str(conf), "-t"], capture_output=True, text=True, env=env)
    assert checked.returncode == 0, checked.stderr
    # Without a service's password in the environment the config does not load: none is built in.
    del env[identities.password_env("enforcer")]
    missing = subprocess.run([find_binary(), "-c", str(conf), "-t"], capture_output=True, text=True, env=env)
    assert missing.returncode != 0 and "NATS_PW_ENFORCER" in missing.stderr + missing.stdout
