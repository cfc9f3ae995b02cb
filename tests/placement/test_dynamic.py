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


def test_with_preemption_high_priority_pods_wait_less_and_low_ones_pay_for_it():
    without = dynamic.replay(NODES, _pods(), "fragmentation-aware", 2.0, fleet_of=bench.build_fleet, high=0.2)
    with_ = dynamic.replay(NODES, _pods(), "fragmentation-aware", 2.0, fleet_of=bench.build_fleet, high=0.2,
                           preemption=True, frag_of=bench.cluster_fragmentation)
    assert without.preemptions_per_1000 == 0 and without.lost_gpu_seconds == 0
    assert without.high_wait_p99 > 0  # overloaded: high-priority pods wait like the others
    assert with_.preemptions_per_1000 > 0 and with_.lost_gpu_seconds > 0 and 0 < with_.lost_pct < 100
    assert with_.high_wait_p99 < without.high_wait_p99 and with_.high_never_ran <= without.high_never_ran
    assert max(with_.alloc_series) <= 100.0  # victims gone before the pod that took their place came


def test_without_a_priority_mix_nothing_is_preempted():
    r = dynamic.replay(NODES, _pods(), "fragmentation-aware", 2.0, fleet_of=bench.build_fleet, preemption=True)
    assert r.preemptions_per_1000 == 0 and r.lost_gpu_seconds == 0 and r.high_never_ran == 0


def test_the_priority_mix_table_has_each_policy_with_and_without_preemption(tmp_path, capsys):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},32000,262144,2,G2\n" for i in range(2)))
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,creation_time,deletion_time\n" + "".join(
        f"p{i},2000,4096,1,1000,,{i * 10},{i * 10 + 100}\n" for i in range(40)))
    assert bench.main(["dynamic", "--nodes", str(nodes), "--pods", str(pods), "--policy",
                       "fragmentation-aware,fgd-paper", "--load", "2", "--high", "0.2", "--jobs", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert [tuple(c.strip() for c in r.split("|")[2:4]) for r in rows] == [
        ("fragmentation-aware", "off"), ("fragmentation-aware", "on"), ("fgd-paper", "off"), ("fgd-paper", "on")]
    assert bench.main(["dynamic", "--nodes", str(nodes), "--pods", str(pods), "--high", "2"]) == 2
