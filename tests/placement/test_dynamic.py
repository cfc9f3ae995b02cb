"""The dynamic replay (pods arrive and leave, waiting pods retried): behaviour on a tiny trace."""

from tessera.placement.benchmarks import dynamic, packing as bench
from tessera.placement.benchmarks.trace import TraceNode, TracePod

NODES = [TraceNode(f"n{i}", 32000, 262144, 2, "G2") for i in range(2)]


def _pods(n=40, life=100, step=10):
    return [TracePod(f"p{i}", 2000, 4096, 1, 1000, (), i * step, i * step + life) for i in range(n)]


def test_light_load_runs_everything_without_waiting():
    r = dynamic.replay(NODES, _pods(), "fragmentation-aware", 0.3, fleet_of=bench.build_fleet)
    assert r.never_ran == 0 and r.waited == 0 and r.served_pct == 100.0
    assert 0 < r.alloc_mean <= 100 and len(r.alloc_series) == 10


def test_overload_makes_pods_wait_and_serves_less_than_asked():
    r = dynamic.replay(NODES, _pods(), "fgd-paper", 2.0, fleet_of=bench.build_fleet)
    assert r.waited > 0 and r.served_pct < 100.0
    assert max(r.alloc_series) <= 100.0
    assert r.wait_p99 >= r.wait_p50 >= 0


def test_a_list_without_times_is_refused():
    import pytest
    with pytest.raises(ValueError, match="creation_time"):
        dynamic.replay(NODES, [TracePod("x", 1, 1, 1, 1000)], "random", 1.0, fleet_of=bench.build_fleet)
