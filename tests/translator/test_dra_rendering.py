"""ClaimSpecs render as resource.k8s.io/v1 ResourceClaims and templates the API server accepts."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest

from tessera.shared.events import ClaimSpec
from tessera.translator import dra
from tessera.translator.hami import translate

K8S = "1.34"  # resource.k8s.io/v1 and consumable capacity (KEP-5075) first appear here


def valid(doc: dict) -> dict:
    kubernetes_validate.validate(doc, K8S, strict=True)
    return doc


def test_claim_has_the_v1_shape():
    spec = ClaimSpec(gpus=1, memory_mib=8000, cores=30)
    doc = valid(dra.resource_claim(spec, "train-gpu", "team-a"))
    assert doc["apiVersion"] == "resource.k8s.io/v1"
    assert doc["kind"] == "ResourceClaim"
    assert doc["metadata"] == {"name": "train-gpu", "namespace": "team-a"}
    (request,) = doc["spec"]["devices"]["requests"]
    assert request["name"] == "gpu"
    assert request["exactly"] == {
        "deviceClassName": "gpu.tessera.dev",
        "allocationMode": "ExactCount",
        "count": 1,
        "capacity": {"requests": {"memory": "8000Mi", "cores": "30"}},
    }
    assert "constraints" not in doc["spec"]["devices"]


def test_template_wraps_the_same_claim_spec():
    spec = ClaimSpec(gpus=2, memory_percent=50, cores=0)
    doc = valid(dra.resource_claim_template(spec, "tessera-train-abc", "team-a", labels={"a": "b"}))
    assert doc["kind"] == "ResourceClaimTemplate"
    assert doc["spec"]["metadata"] == {"labels": {"a": "b"}}
    assert doc["spec"]["spec"] == dra.claim_spec(spec)


def test_zero_cores_is_requested_explicitly_and_whole_card_memory_is_left_to_the_device():
    spec = translate({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "0"})
    capacity = dra.device_request(spec)["exactly"]["capacity"]
    # An absent "cores" would consume the whole card's cores; an absent "memory" is the whole card.
    assert capacity == {"requests": {"cores": "0"}}


def test_several_gpus_must_be_distinct_devices():
    doc = valid(dra.resource_claim(ClaimSpec(gpus=4, memory_mib=1000), "c"))
    assert doc["spec"]["devices"]["requests"][0]["exactly"]["count"] == 4
    assert doc["spec"]["devices"]["constraints"] == [
        {"requests": ["gpu"], "distinctAttribute": "gpu.tessera.dev/uuid"}
    ]


def test_type_and_uuid_selectors_are_cel_over_device_attributes():
    spec = translate(
        {"nvidia.com/gpu": "1"},
        {
            "nvidia.com/use-gputype": "A100,h100",
            "nvidia.com/nouse-gputype": "PCIe",
            "nvidia.com/use-gpuuuid": "GPU-1,GPU-2",
            "nvidia.com/nouse-gpuuuid": 'GPU-"3',
        },
    )
    doc = valid(dra.resource_claim(spec, "c"))
    exprs = [s["cel"]["expression"] for s in doc["spec"]["devices"]["requests"][0]["exactly"]["selectors"]]
    attr = 'device.attributes["gpu.tessera.dev"]'
    assert exprs == [
        f'["A100", "H100"].exists(t, {attr}.model.upperAscii().contains(t))',
        f'!["PCIE"].exists(t, {attr}.model.upperAscii().contains(t))',
        f'{attr}.uuid in ["GPU-1", "GPU-2"]',
        f'!({attr}.uuid in ["GPU-\\"3"])',  # quotes escaped, not injected
    ]


def test_no_selectors_field_without_selectors():
    assert "selectors" not in dra.device_request(ClaimSpec())["exactly"]


def test_parameters_carry_what_dra_cannot_express():
    spec = translate(
        {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "25", "nvidia.com/priority": "0"},
        {"hami.io/node-scheduler-policy": "spread", "hami.io/gpu-scheduler-policy": "binpack"},
    )
    (config,) = dra.claim_spec(spec)["devices"]["config"]
    assert config["requests"] == ["gpu"]
    assert config["opaque"]["driver"] == "gpu.tessera.dev"
    assert config["opaque"]["parameters"] == {
        "apiVersion": "gpu.tessera.dev/v1alpha1",
        "kind": "GpuClaimParameters",
        "gpus": 1,
        "memoryPercent": 25,
        "cores": 0,
        "priority": 0,
        "taskPriority": 0,  # HAMi's high runtime priority: 0 is kept, not dropped as a default
        "nodePolicy": "spread",
        "gpuPolicy": "binpack",
    }


def test_memory_percent_becomes_one_subrequest_per_known_model():
    spec = translate(
        {"nvidia.com/gpu": "2", "nvidia.com/gpumem-percentage": "50", "nvidia.com/gpucores": "20"},
        {"nvidia.com/nouse-gputype": "T4"},
    )
    cards = {"NVIDIA H100 80GB HBM3": 81559, "NVIDIA A100-SXM4-40GB": 40960, "Tesla T4": 15360}
    doc = valid(dra.resource_claim(spec, "c", card_memory_mib=cards))
    (request,) = doc["spec"]["devices"]["requests"]
    assert "exactly" not in request
    subs = request["firstAvailable"]
    assert [s["name"] for s in subs] == ["nvidia-a100-sxm4-40gb", "nvidia-h100-80gb-hbm3"]
    # HAMi sizes a percentage on the chosen card: total * pct / 100, rounded down.
    assert [s["capacity"]["requests"] for s in subs] == [
        {"memory": "20480Mi", "cores": "20"},
        {"memory": "40779Mi", "cores": "20"},
    ]
    assert all(s["count"] == 2 for s in subs)
    assert subs[0]["selectors"][-1]["cel"]["expression"].endswith('.model == "NVIDIA A100-SXM4-40GB"')
    assert doc["spec"]["devices"]["constraints"][0]["requests"] == ["gpu"]


def test_memory_percent_with_no_eligible_model_is_an_error():
    spec = translate({"nvidia.com/gpumem-percentage": "50"}, {"nvidia.com/use-gputype": "B200"})
    with pytest.raises(ValueError, match="type selectors"):
        dra.device_request(spec, card_memory_mib={"NVIDIA H100": 81559})


def test_memory_percent_without_models_leaves_memory_to_the_opaque_config():
    spec = ClaimSpec(memory_percent=30)
    request = dra.device_request(spec)
    assert request["exactly"]["capacity"] == {"requests": {"cores": "0"}}
    assert dra.parameters(spec)["memoryPercent"] == 30


@pytest.mark.parametrize(
    "spec",
    [
        ClaimSpec(),
        ClaimSpec(gpus=2, memory_mib=8000, cores=30, use_types=["H100"], nouse_uuids=["GPU-1"],
                  node_policy="spread", gpu_policy="binpack", priority=1, cpu_millis=500,
                  host_memory_mib=1024, node="n1"),
        ClaimSpec(memory_percent=50, nouse_types=["T4"], use_uuids=["GPU-a", "GPU-b"]),
    ],
    ids=["defaults", "everything", "percent"],
)
def test_parameters_carry_the_whole_claim_back(spec):
    assert dra.spec_from_parameters(dra.parameters(spec)) == spec


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ("x", "must be an object"),
        ({"apiVersion": "v1", "kind": "GpuClaimParameters"}, "apiVersion gpu.tessera.dev/v1alpha1"),
        ({**dra.parameters(ClaimSpec()), "memmory": 1}, "unknown keys ['memmory']"),
        ({**dra.parameters(ClaimSpec()), "gpus": 40}, "parameters.gpus"),
    ],
    ids=["not-object", "wrong-kind", "typo", "out-of-range"],
)
def test_bad_parameters_name_what_is_wrong(params, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        dra.spec_from_parameters(params)
