"""Every object under deploy/k8s is valid against the real Kubernetes OpenAPI schemas, strictly.

Strict mode rejects unknown fields, which is how a misspelt or misplaced key (a probe at pod level,
``requests`` outside ``resources``) is caught here rather than silently dropped by the API server
(or rejected by it at `kubectl apply` time, far from the commit that broke it).
"""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest

from cert_manager import SCHEMAS as CERT_MANAGER_SCHEMAS
from deploy_sources import K8S_VERSION, manifests

# Kinds kubernetes-validate has no schema for: instances of CustomResourceDefinitions that are not
# part of Kubernetes (cert-manager's, for the webhook certificate), checked against cert-manager's
# v1 shapes instead (cert_manager.py). Listed, not guessed: any other kind without a schema fails.
NO_SCHEMA = set(CERT_MANAGER_SCHEMAS)


@pytest.mark.parametrize("manifest", manifests(), ids=lambda m: m.id)
def test_manifest_matches_kubernetes_schema(manifest):
    obj = manifest.obj
    key = (obj.get("apiVersion"), obj.get("kind"))
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        if key in NO_SCHEMA:
            error = jsonschema.exceptions.best_match(
                jsonschema.Draft202012Validator(CERT_MANAGER_SCHEMAS[key]).iter_errors(obj))
            if error is not None:
                path = ".".join(str(p) for p in error.absolute_path)
                pytest.fail(f"{manifest.id} is invalid for cert-manager v1 at {path or '<root>'}: {error.message}")
            return
        pytest.fail(f"no Kubernetes {K8S_VERSION} schema for {key[1]} ({key[0]}): wrong apiVersion, or add it to NO_SCHEMA")
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{manifest.id} is invalid for Kubernetes {K8S_VERSION} at {path or '<root>'}: {exc.message}")
    else:
        assert key not in NO_SCHEMA, f"{key} has a schema now: remove it from NO_SCHEMA"


def test_every_object_names_its_namespace_or_is_cluster_scoped():
    """Without kustomize's namespace: a namespaced object must say where it goes."""
    cluster_scoped = {
        "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "DeviceClass",
        "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration", "PriorityClass",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    }
    missing = [m.id for m in manifests() if m.obj["kind"] not in cluster_scoped and not m.obj["metadata"].get("namespace")]
    assert not missing, f"namespaced objects without metadata.namespace: {missing}"


def test_object_names_are_unique():
    seen: dict[tuple, str] = {}
    for m in manifests():
        key = (m.obj["apiVersion"].split("/")[0], m.obj["kind"], m.obj["metadata"].get("namespace"), m.obj["metadata"]["name"])
        assert key not in seen, f"{m.id} has the same kind and name as {seen[key]}"
        seen[key] = m.id
