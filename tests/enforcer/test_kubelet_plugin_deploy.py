"""The enforcer's DaemonSet as a kubelet plugin: it shares the kubelet's directories at the paths
its settings name, and its RBAC is exactly the one call the plugin makes."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tessera.enforcer.settings import EnforcerSettings

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "k8s" / "enforcer.yaml"
ENFORCER = ROOT / "services" / "enforcer" / "src" / "tessera" / "enforcer"


def objects() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc}


def test_the_daemonset_mounts_the_kubelets_directories_where_its_settings_point():
    spec = objects()["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    settings = EnforcerSettings.from_env({k: v for k, v in env.items() if v is not None} | {"TESSERA_NODE": "n"})
    assert settings.kubernetes
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    host = {v["name"]: v.get("hostPath", {}).get("path") for v in spec["volumes"]}
    for path in (settings.kubelet_registry_dir, settings.kubelet_plugin_dir, settings.cdi_dir):
        mount = mounts[str(path)]
        assert host[mount["name"]] == str(path) and not mount.get("readOnly")
    # the defaults are the kubelet's own paths, so a bare setting serves a stock kubelet
    defaults = EnforcerSettings.from_env({"TESSERA_NODE": "n", "TESSERA_KUBERNETES": "true"})
    assert (defaults.kubelet_registry_dir, defaults.kubelet_plugin_dir, defaults.cdi_dir) == \
        (settings.kubelet_registry_dir, settings.kubelet_plugin_dir, settings.cdi_dir)


def test_rbac_is_exactly_what_the_plugin_calls():
    (rule,) = objects()["ClusterRole"]["rules"]
    assert rule == {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]}
    # ... and the enforcer's only Kubernetes calls are the adapter's one GET of a ResourceClaim
    callers = sorted(p.relative_to(ENFORCER).as_posix() for p in ENFORCER.rglob("*.py")
                     if re.search(r"kubeapi|kubernetes_asyncio", p.read_text()))
    assert callers == ["kubelet/kube.py"]
    source = (ENFORCER / "kubelet" / "kube.py").read_text()
    assert [call for call in re.findall(r"self\.api\.(\w+)\(", source) if call not in ("api", "close")] == ["get"]
    assert '"resourceclaims"' in source


def test_a_relative_kubelet_directory_is_refused_by_name():
    import pytest

    from tessera.shared.errors import ConfigError

    with pytest.raises(ConfigError, match="TESSERA_KUBELET_PLUGIN_DIR='plugins' must be an absolute path"):
        EnforcerSettings.from_env({"TESSERA_NODE": "n", "TESSERA_KUBELET_PLUGIN_DIR": "plugins"})
    # a local fleet keeps its CDI specs in its state directory
    local = EnforcerSettings.from_env({"TESSERA_NODE": "n", "TESSERA_STATE_DIR": "/tmp/x"})
    assert not local.kubernetes and local.cdi_dir == Path("/tmp/x/cdi")


def test_the_daemonset_gives_the_specs_the_hosts_driver_and_installs_their_hook():
    spec = objects()["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    settings = EnforcerSettings.from_env({k: v for k, v in env.items() if v is not None} | {"TESSERA_NODE": "n"})
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    host = {v["name"]: v.get("hostPath", {}).get("path") for v in spec["volumes"]}
    # The driver root is read where it is mounted (read-only), and named in the specs by the host's path.
    root = mounts[str(settings.driver_root)]
    assert root.get("readOnly") and host[root["name"]] == str(settings.driver_root_on_host)
    assert settings.dev_root == settings.driver_root / "dev"  # the host's /dev, not the pod's
    # The hook the specs name is where the init container installs it, at the same path on the host.
    hook = settings.cdi_hook
    assert host[mounts[str(hook.parent)]["name"]] == str(hook.parent)
    (init,) = spec["initContainers"]
    script = " ".join(init["command"])
    assert f"/host-vgpu/{hook.name}" in script and "/usr/local/lib/tessera/tessera-cdi-hook" in script
    assert {m["mountPath"]: m["name"] for m in init["volumeMounts"]}["/host-vgpu"] == mounts[str(hook.parent)]["name"]
