"""The policy registry: one entry per policy, and the lists read from it stay in step."""

import typing

import pytest
from fleetkit import inventory

from tessera.placement import settings
from tessera.placement.benchmarks import packing as bench
from tessera.placement.engine import Placement, Placer, ledger_entry
from tessera.placement.fleet import Fleet
from tessera.placement.policies import BENCH_COLUMNS, NAMES, POLICY, SERVICE_NAMES, policy
from tessera.shared.events import ClaimSpec, Policy as WirePolicy


def test_what_a_claim_may_ask_for_is_what_the_service_offers():
    assert set(typing.get_args(WirePolicy)) == set(SERVICE_NAMES)
    assert settings.POLICIES == SERVICE_NAMES


def test_the_benchmark_compares_every_policy_with_ours_last():
    assert sorted(BENCH_COLUMNS) == sorted(NAMES) and bench.BASELINES == BENCH_COLUMNS
    assert BENCH_COLUMNS[-1] == "fragmentation-aware"


def test_every_baseline_has_both_parts_of_its_score():
    for p in POLICY.values():
        assert (p.node_term is None) == (p.node_score is None) == (p.scoring != "baseline"), p.name


def test_an_unknown_policy_is_refused_with_the_names_there_are():
    with pytest.raises(ValueError, match="unknown policy 'tightest'.*binpack.*fgd-paper"):
        policy("tightest")
    with pytest.raises(ValueError, match="unknown policy 'tightest'"):
        Placer(Fleet(), "tightest")


@pytest.mark.parametrize("name", [p for p in NAMES if POLICY[p].scoring == "baseline"])
def test_a_baseline_scores_alike_through_its_memo_and_node_by_node(harness, name):
    """The memoised class index and the per-node path (taken when the caller excludes a node) call
    the same scorer: every decision lands on the same node, GPUs and score."""
    nodes = [inventory(f"n{i}", gpus=1 + i % 4, cpu_millis=8000 * (1 + i % 3),
                       host_memory_mib=65536 * (1 + i % 2)) for i in range(6)]
    memo, each = harness(*nodes, default_node_policy=name), harness(*nodes, default_node_policy=name)
    sizes = [dict(memory_mib=20000, cores=30, cpu_millis=2000, host_memory_mib=8192),
             dict(memory_percent=50, cores=50, cpu_millis=4000), dict(gpus=2, memory_mib=40000, cores=60)]
    placed = 0
    for i in range(24):
        spec = ClaimSpec(**sizes[i % 3])
        a = memo.placer.place(f"c{i}", "team-a", spec)
        b = each.placer.place(f"c{i}", "team-a", spec, ("not-a-node",))
        assert isinstance(a, Placement) == isinstance(b, Placement), (name, i)
        if isinstance(a, Placement):
            assert (a.node, a.shares, a.score) == (b.node, b.shares, b.score), (name, i)
            for h in (memo, each):
                h.fleet.commit(a.node, ledger_entry(f"c{i}", "team-a", spec, a))
            placed += 1
    assert placed >= 12
