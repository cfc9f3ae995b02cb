"""deploy/k8s/kustomization.yaml applies everything under deploy/k8s, and only what exists.

A manifest added next to the others but not listed is never applied, and nothing complains; a listed
file that was renamed breaks `kubectl apply -k` for everyone. When kubectl is installed the real
kustomize renders the base, so patches that no longer match their target fail here too.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from deploy_sources import K8S, manifest_files, manifests


def _kustomization(directory=K8S) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def _listed_files(directory=K8S) -> set:
    """Files a kustomization applies, following listed directories' own kustomizations."""
    out = set()
    for entry in _kustomization(directory).get("resources", []):
        target = directory / entry
        if target.is_dir():
            out |= _listed_files(target)
        else:
            out.add(target.resolve())
    return out


def test_every_manifest_file_is_listed():
    listed = _listed_files()
    forgotten = [str(p) for p in manifest_files() if (K8S / p).resolve() not in listed]
    assert not forgotten, f"not in deploy/k8s/kustomization.yaml resources: {forgotten}"


def test_every_listed_resource_exists():
    missing = [entry for entry in _kustomization().get("resources", []) if not (K8S / entry).exists()]
    assert not missing, f"kustomization.yaml lists files that do not exist: {missing}"


def test_namespace_comes_first_and_crds_before_their_users():
    resources = _kustomization()["resources"]
    assert resources[0] == "namespace.yaml"
    crds = [i for i, r in enumerate(resources) if r.startswith("crds")]
    assert all(i < resources.index("controlplane/manager.yaml") for i in crds)


def test_kustomize_renders_every_object_once():
    kubectl = shutil.which("kubectl")
    if kubectl is None:  # never a skip: CI would pass with the kustomization unrendered
        pytest.fail("kubectl is not installed: this test renders deploy/k8s with `kubectl kustomize`; install "
                    "kubectl (https://kubernetes.io/docs/tasks/tools/) and put it on PATH", pytrace=False)
    rendered = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=False
    )
    assert rendered.returncode == 0, rendered.stderr
    objects = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    assert len(objects) == len(manifests())
    # The shared settings patch reached the control-plane manager's Deployment.
    (manager,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "tessera-controlplane"]
    env_from = manager["spec"]["template"]["spec"]["containers"][0].get("envFrom", [])
    assert {"configMapRef": {"name": "tessera-env"}} in env_from
