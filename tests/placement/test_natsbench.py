"""`tessera bench placement-nats` end to end on a tiny fleet: every claim decided, models side by side.

Behaviour only (the figures are for `make bench`): a real nats-server and real placement processes,
one per model, on synthetic trace files.
"""

from __future__ import annotations

import json

from tessera.placement.benchmarks import through_nats as natsbench

NODES = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
    f"n{i},{64000 if i % 2 else 96000},262144,{8 if i % 3 else 2},{'G2' if i % 2 else 'T4'}\n" for i in range(20))
PODS = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
        "whole,8000,16384,1,1000\nhalf,4000,8192,1,500\nthird,4000,8192,1,300\ntwo,16000,32768,2,1000\n")


def test_models_are_measured_side_by_side_and_every_claim_is_decided(tmp_path, capsys):
    (tmp_path / "n.csv").write_text(NODES)
    (tmp_path / "p.csv").write_text(PODS)
    out = tmp_path / "runs.json"
    code = natsbench.main(["--fleet", "openb", "--nodes", str(tmp_path / "n.csv"), "--pods", str(tmp_path / "p.csv"),
                           "--claims", "60", "--rate", "50", "--latency-seconds", "0.4", "--repeat", "1",
                           "--models", "default,python-core", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "python-core" in table and "ratio" in table
    runs = json.loads(out.read_text())
    assert [r["model"] for r in runs] == ["default", "python-core"]
    assert all(r["allocated"] == 60 and r["nodes"] == 20 for r in runs)


def test_an_unknown_model_is_refused_with_the_known_ones(capsys):
    assert natsbench.main(["--models", "default,fastest"]) == 2
    err = capsys.readouterr().err
    assert "fastest" in err and "python-core" in err
