"""The packing benchmark (FGD paper's method) on a tiny synthetic trace: behaviour, not timings."""

import json
import subprocess
import sys

from tessera.placement.benchmarks import packing as bench

NODES = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
    f"n{i},{32000 if i % 3 else 96000},262144,{8 if i % 2 else 2},{'G2' if i % 2 else 'T4'}\n" for i in range(12))
PODS = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
        "whole,8000,16384,1,1000\nhalf,4000,8192,1,500\nthird,4000,8192,1,300\neight,32000,65536,8,1000\n"
        "cpu,16000,32768,0,0\nsmall,2000,4096,1,100\n")


def _run(tmp_path, policy, seeds="1-2"):
    (tmp_path / "n.csv").write_text(NODES)
    (tmp_path / "p.csv").write_text(PODS)
    bench._load(str(tmp_path / "n.csv"), str(tmp_path / "p.csv"))
    return [bench.simulate(policy, s) for s in bench.parse_seeds(seeds)]


def test_curve_runs_to_130_percent_and_never_over_allocates(tmp_path):
    for r in _run(tmp_path, "fragmentation-aware"):
        xs = [c["arrival_pct"] for c in r["curve"]]
        assert xs == list(range(1, 131))
        ys = [c["allocated_pct"] for c in r["curve"]]
        assert ys == sorted(ys)  # tasks never leave
        assert all(y <= 100 + 1e-9 for y in ys)
        assert r["unallocated_pct_at_100"] == round(100 - ys[99], 4)
        assert all(0 <= c["frag_rate_pct"] <= 100 for c in r["curve"])


def test_fragmentation_aware_packs_no_worse_than_random(tmp_path):
    fgd = _run(tmp_path, "fragmentation-aware", "1-4")
    rnd = _run(tmp_path, "random", "1-4")
    assert sum(r["unallocated_pct_at_100"] for r in fgd) <= sum(r["unallocated_pct_at_100"] for r in rnd)


def test_seeds_are_reproducible(tmp_path):
    a = _run(tmp_path, "best-fit", "7")
    b = _run(tmp_path, "best-fit", "7")
    assert a[0]["curve"] == b[0]["curve"]


def test_cli_writes_json_and_table(tmp_path):
    (tmp_path / "n.csv").write_text(NODES)
    (tmp_path / "p.csv").write_text(PODS)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tessera.placement.benchmarks.packing", "placement", "--nodes", str(tmp_path / "n.csv"),
         "--pods", str(tmp_path / "p.csv"), "--policy", "binpack,fragmentation-aware", "--seeds", "1-2",
         "--jobs", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=True)
    assert "fragmentation-aware" in proc.stdout and "binpack" in proc.stdout
    data = json.loads(out.read_text())
    fa = data["policies"]["fragmentation-aware"]
    assert isinstance(fa["unallocated_pct_at_100"], float)
    assert set(fa["curve"][0]) == {"arrival_pct", "allocated_pct", "frag_rate_pct"}


def test_cli_reports_bad_trace(tmp_path):
    (tmp_path / "n.csv").write_text(NODES)
    (tmp_path / "p.csv").write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\nx,1,1,3,500\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tessera.placement.benchmarks.packing", "placement", "--nodes", str(tmp_path / "n.csv"),
         "--pods", str(tmp_path / "p.csv")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "p.csv:2:" in proc.stderr


def test_families_table_puts_ours_and_the_papers_fgd_side_by_side(tmp_path):
    (tmp_path / "n.csv").write_text(NODES)
    (tmp_path / "p.csv").write_text(PODS)
    md = tmp_path / "families.md"
    proc = subprocess.run(
        [sys.executable, "-m", "tessera.placement.benchmarks.packing", "placement", "--families", "--nodes",
         str(tmp_path / "n.csv"), "--pods", str(tmp_path / "p.csv"), "--seeds", "1-2", "--jobs", "1",
         "--cpu-only", "3", "--gpu-share", "50", "--gpu-spec", "50", "--multi-gpu", "2,3", "--md", str(md)],
        capture_output=True, text=True, timeout=300, check=True)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert "fragmentation-aware" in rows[0] and "fgd-paper" in rows[0]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["default", "cpu-only", "gpu-share", "gpu-spec",
                                                          "multi-gpu", "multi-gpu"]
    assert "3 CPU-only pods" in proc.stdout and "50% of GPU pods typed" in proc.stdout
    assert "--multi-gpu 2,3" in md.read_text() and rows[-1] in md.read_text()


def test_families_refuse_a_bad_level(tmp_path):
    (tmp_path / "n.csv").write_text(NODES)
    (tmp_path / "p.csv").write_text(PODS)
    proc = subprocess.run(
        [sys.executable, "-m", "tessera.placement.benchmarks.packing", "placement", "--families", "--nodes",
         str(tmp_path / "n.csv"), "--pods", str(tmp_path / "p.csv"), "--gpu-share", "150"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "percentages" in proc.stderr
