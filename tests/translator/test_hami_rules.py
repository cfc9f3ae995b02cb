"""HAMi's resource names and annotations translate as HAMi reads them, or are refused clearly."""

from __future__ import annotations

import pytest

from tessera.shared.events import ClaimSpec
from tessera.translator.hami import (
    HamiDefaults,
    TranslationError,
    is_gpu_request,
    translate,
)

GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
PCT = "nvidia.com/gpumem-percentage"
CORES = "nvidia.com/gpucores"
PRIO = "nvidia.com/priority"

WHOLE = {"memory_mib": None, "memory_percent": 100, "cores": 100}

ACCEPTED = [
    # (id, resources, annotations, expected ClaimSpec fields)
    ("gpu-only-is-whole-exclusive-card", {GPU: "1"}, {}, {"gpus": 1, **WHOLE}),
    ("gpu-as-int", {GPU: 2}, {}, {"gpus": 2, **WHOLE}),
    ("gpumem-mib", {GPU: "1", MEM: "3000"}, {}, {"memory_mib": 3000, "memory_percent": None, "cores": 0}),
    ("gpumem-canonical-10k", {GPU: "1", MEM: "10k"}, {}, {"memory_mib": 10000}),
    ("gpumem-exponent", {GPU: "1", MEM: "4e3"}, {}, {"memory_mib": 4000}),
    ("gpumem-implies-one-gpu", {MEM: "8192"}, {}, {"gpus": 1, "memory_mib": 8192, "cores": 0}),
    ("cores-implies-one-gpu", {CORES: "30"}, {}, {"gpus": 1, "memory_percent": 100, "cores": 30}),
    ("percent", {GPU: "2", PCT: "50"}, {}, {"gpus": 2, "memory_percent": 50, "memory_mib": None, "cores": 0}),
    ("percent-100-is-exclusive", {GPU: "1", PCT: "100"}, {}, {"memory_percent": 100, "cores": 100}),
    ("cores-explicit-zero", {GPU: "1", CORES: "0"}, {}, {"memory_percent": 100, "cores": 0}),
    ("cores-100", {GPU: "1", MEM: "4000", CORES: "100"}, {}, {"memory_mib": 4000, "cores": 100}),
    # HAMi's priority is the runtime one: kept as task_priority, never the scheduling priority.
    ("priority-high", {GPU: "1", PRIO: "0"}, {}, {"task_priority": 0, "priority": 0}),
    ("priority-low", {GPU: "1", PRIO: "1"}, {}, {"task_priority": 1, "priority": 0}),
    ("priority-unset", {GPU: "1"}, {}, {"task_priority": None, "priority": 0}),
    ("cpu-and-memory-ignored", {GPU: "1", "cpu": "2", "memory": "4Gi"}, {}, {"gpus": 1}),
    ("mig-resource-left-alone", {GPU: "1", "nvidia.com/mig-1g.5gb": "1"}, {}, {"gpus": 1}),
    (
        "type-lists-trimmed-and-deduplicated",
        {GPU: "1"},
        {"nvidia.com/use-gputype": " A100 ,H100,a100", "nvidia.com/nouse-gputype": "T4"},
        {"use_types": ["A100", "H100"], "nouse_types": ["T4"]},
    ),
    (
        "nouse-narrower-than-use-is-fine",
        {GPU: "1"},
        {"nvidia.com/use-gputype": "A100", "nvidia.com/nouse-gputype": "A100-40GB"},
        {"use_types": ["A100"], "nouse_types": ["A100-40GB"]},
    ),
    (
        "uuids",
        {GPU: "2"},
        {"nvidia.com/use-gpuuuid": "GPU-a, GPU-b,GPU-c", "nvidia.com/nouse-gpuuuid": "GPU-d"},
        {"use_uuids": ["GPU-a", "GPU-b", "GPU-c"], "nouse_uuids": ["GPU-d"]},
    ),
    (
        "policies",
        {GPU: "1"},
        {"hami.io/node-scheduler-policy": "spread", "hami.io/gpu-scheduler-policy": "binpack"},
        {"node_policy": "spread", "gpu_policy": "binpack"},
    ),
    (
        "tessera-policies",
        {GPU: "1"},
        {"hami.io/node-scheduler-policy": "best-fit", "hami.io/gpu-scheduler-policy": " fragmentation-aware"},
        {"node_policy": "best-fit", "gpu_policy": "fragmentation-aware"},
    ),
    ("unrelated-annotations-ignored", {GPU: "1"}, {"example.com/team": "a"}, {"gpus": 1}),
]


@pytest.mark.parametrize(("resources", "annotations", "expected"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_accepted_requests_translate_like_hami(resources, annotations, expected):
    spec = translate(resources, annotations)
    assert isinstance(spec, ClaimSpec)
    for field, value in expected.items():
        assert getattr(spec, field) == value, field


def test_hami_defaults_are_honoured():
    assert translate({GPU: "1"}, defaults=HamiDefaults(memory_mib=5000)).memory_mib == 5000
    # HAMi still makes a card exclusive when no memory resource was set, whatever defaultMemory is.
    assert translate({GPU: "1"}, defaults=HamiDefaults(memory_mib=5000)).cores == 100
    assert translate({GPU: "1", MEM: "1000"}, defaults=HamiDefaults(cores=20)).cores == 20
    assert translate({MEM: "1000"}, defaults=HamiDefaults(gpu_num=2)).gpus == 2


REJECTED = [
    # (id, resources, annotations, field, message fragments)
    ("gpucores-150", {GPU: "1", CORES: "150"}, {}, f'resources["{CORES}"]', ["0 to 100", "clamp it to 100"]),
    ("gpucores-negative", {GPU: "1", CORES: "-5"}, {}, f'resources["{CORES}"]', ["0 to 100"]),
    ("gpu-negative", {GPU: "-1"}, {}, f'resources["{GPU}"]', ["1 to 16"]),
    ("gpu-17", {GPU: "17"}, {}, f'resources["{GPU}"]', ["1 to 16"]),
    ("gpu-fraction", {GPU: "0.5"}, {}, f'resources["{GPU}"]', ["whole number", "fractional"]),
    ("gpu-milli", {GPU: "500m"}, {}, f'resources["{GPU}"]', ["whole number"]),
    ("gpu-word", {GPU: "two"}, {}, f'resources["{GPU}"]', ["not a Kubernetes quantity", "1 to 16"]),
    ("gpu-bool", {GPU: True}, {}, f'resources["{GPU}"]', ["string or an integer"]),
    ("gpu-zero-with-gpumem", {GPU: "0", MEM: "1000"}, {}, f'resources["{GPU}"]', ["0 GPUs", MEM, "no GPU"]),
    ("gpu-zero-alone", {GPU: "0"}, {}, f'resources["{GPU}"]', ["0 GPUs"]),
    ("gpumem-8Gi", {GPU: "1", MEM: "8Gi"}, {}, f'resources["{MEM}"]', ["counts MiB", "Write 8192"]),
    ("gpumem-1.5Gi", {GPU: "1", MEM: "1.5Gi"}, {}, f'resources["{MEM}"]', ["counts MiB", "Write 1536"]),
    ("gpumem-zero", {GPU: "1", MEM: "0"}, {}, f'resources["{MEM}"]', ["1 to 1048576", "whole card"]),
    ("gpumem-too-big", {GPU: "1", MEM: "2000000"}, {}, f'resources["{MEM}"]', ["1 to 1048576"]),
    ("gpumem-fraction", {GPU: "1", MEM: "100.5"}, {}, f'resources["{MEM}"]', ["whole number"]),
    ("gpumem-huge-exponent", {GPU: "1", MEM: "1e99"}, {}, f'resources["{MEM}"]', ["not a Kubernetes quantity"]),
    ("gpumem-trailing-newline", {GPU: "1", MEM: "100\n"}, {}, f'resources["{MEM}"]', ["not a Kubernetes quantity"]),
    ("percent-zero", {GPU: "1", PCT: "0"}, {}, f'resources["{PCT}"]', ["1 to 100"]),
    ("percent-150", {GPU: "1", PCT: "150"}, {}, f'resources["{PCT}"]', ["1 to 100", "Pending"]),
    ("gpumem-and-percent", {GPU: "1", MEM: "1000", PCT: "50"}, {}, f'resources["{PCT}"]', ["Set only one"]),
    ("priority-2", {GPU: "1", PRIO: "2"}, {}, f'resources["{PRIO}"]', ["0 (high) or 1 (low)"]),
    ("priority-without-gpu", {PRIO: "0"}, {}, f'resources["{PRIO}"]', ["asks for no GPU"]),
    ("nothing", {"cpu": "1"}, {}, "resources", ["no GPU"]),
    ("typo-gpumemory", {GPU: "1", "nvidia.com/gpumemory": "1000"}, {}, 'resources["nvidia.com/gpumemory"]', ["Did you mean 'nvidia.com/gpumem'"]),
    ("typo-gpucore", {"nvidia.com/gpucore": "10"}, {}, 'resources["nvidia.com/gpucore"]', ["Did you mean 'nvidia.com/gpucores'"]),
    (
        "use-and-nouse-same-type",
        {GPU: "1"},
        {"nvidia.com/use-gputype": "A100", "nvidia.com/nouse-gputype": "a100"},
        'annotations["nvidia.com/nouse-gputype"]',
        ["can never match"],
    ),
    (
        "nouse-covers-use",
        {GPU: "1"},
        {"nvidia.com/use-gputype": "A100-80GB,H100", "nvidia.com/nouse-gputype": "A100"},
        'annotations["nvidia.com/nouse-gputype"]',
        ["'A100-80GB'", "can never match"],
    ),
    (
        "empty-type-entry",
        {GPU: "1"},
        {"nvidia.com/use-gputype": "A100,"},
        'annotations["nvidia.com/use-gputype"]',
        ["empty entry", "every GPU"],
    ),
    (
        "uuid-both-lists",
        {GPU: "1"},
        {"nvidia.com/use-gpuuuid": "GPU-a,GPU-b", "nvidia.com/nouse-gpuuuid": "GPU-b"},
        'annotations["nvidia.com/nouse-gpuuuid"]',
        ["GPU-B", "both"],
    ),
    (
        "uuid-fewer-than-gpus",
        {GPU: "2"},
        {"nvidia.com/use-gpuuuid": "GPU-a"},
        'annotations["nvidia.com/use-gpuuuid"]',
        ["2 distinct GPUs", "at least 2"],
    ),
    (
        "uuid-with-space",
        {GPU: "1"},
        {"nvidia.com/use-gpuuuid": "GPU-a GPU-b"},
        'annotations["nvidia.com/use-gpuuuid"]',
        ["whitespace"],
    ),
    (
        "unknown-policy",
        {GPU: "1"},
        {"hami.io/gpu-scheduler-policy": "pack-tight"},
        'annotations["hami.io/gpu-scheduler-policy"]',
        ["binpack, spread, fragmentation-aware, best-fit"],
    ),
    (
        "policy-wrong-case",
        {GPU: "1"},
        {"hami.io/node-scheduler-policy": "Spread"},
        'annotations["hami.io/node-scheduler-policy"]',
        ["write 'spread'"],
    ),
    (
        "topology-aware",
        {GPU: "1"},
        {"hami.io/gpu-scheduler-policy": "topology-aware"},
        'annotations["hami.io/gpu-scheduler-policy"]',
        ["not supported"],
    ),
]


@pytest.mark.parametrize(
    ("resources", "annotations", "field", "fragments"), [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED]
)
def test_bad_requests_are_rejected_with_a_message(resources, annotations, field, fragments):
    with pytest.raises(TranslationError) as caught:
        translate(resources, annotations, where='container "train"')
    err = caught.value
    assert err.field == field
    message = str(err)
    assert message.startswith(f'container "train": {field}')
    for fragment in fragments:
        assert fragment in message, message


def test_error_carries_the_offending_value():
    with pytest.raises(TranslationError) as caught:
        translate({GPU: "1", CORES: "150"})
    assert caught.value.value == "150"
    assert caught.value.where == ""


def test_gpumem_without_gpu_is_rejected_when_default_gpu_num_is_zero():
    with pytest.raises(TranslationError, match="defaultGPUNum is 0"):
        translate({MEM: "1000"}, defaults=HamiDefaults(gpu_num=0))


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        ({GPU: "1"}, True),
        ({MEM: "100"}, True),
        ({PCT: "10"}, True),
        ({CORES: "10"}, True),
        ({PRIO: "0"}, True),
        ({"nvidia.com/gpumemory": "1"}, True),
        ({GPU: "0"}, False),
        ({GPU: 0}, False),
        ({GPU: "garbage"}, True),
        ({"cpu": "1", "memory": "1Gi"}, False),
        ({"nvidia.com/mig-1g.5gb": "1"}, False),
        ({"nvidia.com/gpu.shared": "1"}, False),
        ({}, False),
    ],
)
def test_is_gpu_request(resources, expected):
    assert is_gpu_request(resources) is expected
