"""Workload families made from a pod list (the FGD paper's trace variants): what each level changes."""

import pytest

from tessera.placement.benchmarks import families
from tessera.placement.benchmarks.trace import TraceNode, TracePod

NODES = [TraceNode("a", 96000, 262144, 8, "G2"), TraceNode("b", 32000, 262144, 2, "T4")]
PODS = ([TracePod(f"w{i}", 8000, 16384, 1, 1000) for i in range(6)]
        + [TracePod(f"s{i}", 4000, 8192, 1, 500) for i in range(2)]
        + [TracePod("m", 32000, 65536, 4, 1000), TracePod("c", 16000, 32768, 0, 0)])
GPU_PODS = 9


def test_cpu_only_and_multi_gpu_add_pods_sampled_from_their_own_kind():
    v = families.variant(PODS, NODES, "cpu-only", 5)
    assert v[: len(PODS)] == PODS and sum(p.num_gpu == 0 for p in v) == 5
    assert all((p.cpu_milli, p.memory_mib) == (16000, 32768) for p in v if p.num_gpu == 0)
    m = families.variant(PODS, NODES, "multi-gpu", 4)
    assert sum(p.num_gpu > 1 for p in m) == 4 and len(m) == len(PODS) + 3


def test_gpu_share_replaces_whole_gpu_pods_until_the_share_is_reached():
    v = families.variant(PODS, NODES, "gpu-share", 100)
    assert len(v) == len(PODS)
    assert sum(1 for p in v if p.num_gpu == 1 and p.gpu_milli < 1000) == GPU_PODS
    assert sum(p.num_gpu == 0 for p in v) == 1  # CPU-only pods untouched


def test_gpu_spec_constrains_a_share_of_gpu_pods_to_one_fleet_model():
    v = families.variant(PODS, NODES, "gpu-spec", 50)
    typed = [p for p in v if p.gpu_spec]
    assert len(typed) == 5 and all(p.num_gpu and len(p.gpu_spec) == 1 and p.gpu_spec[0] in ("G2", "T4")
                                   for p in typed)
    assert families.variant(PODS, NODES, "gpu-spec", 50) == v  # deterministic


def test_bad_levels_are_refused_with_what_to_pass():
    with pytest.raises(ValueError, match="percentages"):
        families.parse_levels("120", "gpu-share")
    with pytest.raises(ValueError, match="whole numbers"):
        families.parse_levels("a,b", "cpu-only")
