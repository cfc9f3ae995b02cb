"""deploy/k8s/nats.yaml's authorization is the one `tessera.shared.identities` describes.

The NATS config there is hand-written YAML; this checks that nats-server accepts it with a tenant
account the manager would write included, and that the platform account exports exactly what the
tenant accounts import from it, so the two cannot drift apart.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import yaml

from tessera.shared import identities
from tessera.shared.natsserver import find_binary

from tessera.controlplane.datastores.natskv import UsersFile

NATS_YAML = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "nats.yaml"


def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all(NATS_YAML.read_text()) if d]


def test_the_k8s_nats_config_is_valid_with_a_tenant_account_included(tmp_path):
    config = next(d for d in documents() if d["kind"] == "ConfigMap")["data"]["nats.conf"]
    users = next(d for d in documents() if d["kind"] == "Secret")["stringData"]["users.conf"]
    assert UsersFile(tmp_path / "x", None).parse(users) == {}  # it starts with no tenant
    (tmp_path / "conf").mkdir()
    (tmp_path / "nats-users").mkdir()
    tenants = tmp_path / "nats-users" / "users.conf"
    file = UsersFile(tenants, None)
    file.write({"alpha": identities.tenant_account("alpha", identities.hash_password("secret"))})
    conf = tmp_path / "conf" / "nats.conf"
    conf.write_text(config.replace("/data", str(tmp_path / "data")))
    checked = subprocess.run([find_binary(), "-c", str(conf), "-t"], capture_output=True, text=True,
                             env=dict(os.environ, POD_NAME="nats-0"))
    assert checked.returncode == 0, checked.stderr


def test_the_k8s_platform_account_exports_what_tenant_accounts_import():
    config = next(d for d in documents() if d["kind"] == "ConfigMap")["data"]["nats.conf"]
    exports = re.findall(r"\{(service|stream): \"([^\"]+)\"\}", config)
    assert [{kind: subject} for kind, subject in exports] == identities.PLATFORM_EXPORTS
