"""The TenantControlPlane CRD: current with the spec Structs, a valid CRD, and it agrees with the decoder."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tessera.controlplane import crd
from tessera.controlplane.spec import SpecError, parse_spec

CRD_FILE = Path(__file__).resolve().parents[2] / "deploy/k8s/crds/tenantcontrolplanes.yaml"

SAMPLE = {
    "kubernetes": {"version": "v1.33.1", "replicas": 3},
    "size": "medium",
    "resources": {"scheduler": {"requests": {"cpuMillis": 100, "memoryMib": 128},
                                "limits": {"cpuMillis": 200, "memoryMib": 256}}},
    "network": {"serviceType": "LoadBalancer", "address": "203.0.113.9", "port": 6443,
                "certSans": ["api.example.com"], "nodeCidrs": ["192.168.0.0/24"]},
    "datastore": {"driver": "postgres"},
    "quota": {"gpus": 8, "memoryMib": 320000, "cores": 800},
}


def test_checked_in_crd_is_generated_from_the_current_structs():
    assert CRD_FILE.read_text() == crd.render(), "run: python -m tessera.controlplane.crd > " + str(CRD_FILE)


def test_crd_passes_the_kubernetes_schema():
    kubernetes_validate.validate(yaml.safe_load(CRD_FILE.read_text()), "1.33.0", strict=True)


def test_schema_and_decoder_agree_on_good_and_bad_specs():
    schema = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_schema = schema["properties"]["spec"]
    jsonschema.validate(SAMPLE, spec_schema)
    parse_spec(SAMPLE)
    for bad in ({"size": "huge"}, {"kubernetes": {"replicas": 0}}, {"network": {"port": 0}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, spec_schema)
        with pytest.raises(SpecError):
            parse_spec(bad)


def test_manager_deployment_manifests_pass_the_schema_with_limits():
    path = CRD_FILE.parents[1] / "controlplane/manager.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    for c in deployment["spec"]["template"]["spec"]["containers"]:
        assert c["resources"]["requests"] and c["resources"]["limits"]
