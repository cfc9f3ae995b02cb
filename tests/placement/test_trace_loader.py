"""The openb trace loader: every published variant reads, a bad row names file:line and the problem."""

from pathlib import Path

import pytest

from tessera.placement.benchmarks.trace import (
    GPU_MEMORY_MIB, TraceError, load_nodes, load_pods, node_inventory, pod_demand,
)

OPENB = Path("/work/shared/data/openb")
if not OPENB.exists():
    OPENB = Path(__file__).resolve().parents[3] / "shared" / "data" / "openb"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_node_list_maps_models_to_memory(tmp_path):
    p = _write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\n"
               "openb-node-0001,96000,393216,8,G2\nOpenB_Node_2,32000,131072,4,V100M16\n"
               "cpu-only,64000,262144,0,\n")
    nodes = load_nodes(p)
    assert [n.name for n in nodes] == ["openb-node-0001", "openb-node-2", "cpu-only"]
    inv = node_inventory(nodes[1])
    assert len(inv.devices) == 4 and inv.devices[0].memory_mib == GPU_MEMORY_MIB["V100M16"] == 16384
    assert node_inventory(nodes[2]).devices == []


def test_full_pod_list_with_gpu_spec_and_cpu_only_tasks(tmp_path):
    p = _write(tmp_path, "pods.csv",
               "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
               "deletion_time,scheduled_time\n"
               "p0,12000,16384,1,1000,,LS,Running,0,1,0\n"
               "p1,6000,12288,1,460,V100M16|V100M32,LS,Running,0,1,0\n"
               "p2,8000,30517,0,0,,BE,Running,0,1,0\n"
               "p3,88000,338944,8,1000,G2,LS,Running,0,1,0\n")
    pods = load_pods(p)
    assert [x.gpu_units for x in pods] == [1.0, 0.46, 0.0, 8.0]
    assert pods[1].gpu_spec == ("V100M16", "V100M32")
    d = pod_demand(pods[1])
    assert (d.gpus, d.memory_percent, d.cores, d.use_types) == (1, 46, 46, ("v100m16", "v100m32"))
    assert pod_demand(pods[0]).exclusive and pod_demand(pods[3]).gpus == 8
    assert pod_demand(pods[2]).gpus == 0 and pod_demand(pods[2]).cpu == 8000


def test_five_column_variant_with_and_without_header(tmp_path):
    with_header = _write(tmp_path, "a.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,4000,1024,1,500\n")
    without = _write(tmp_path, "b.csv", "p,4000,1024,1,500\nq,1000,512,0,0\n")
    assert load_pods(with_header)[0].gpu_milli == 500
    assert [x.num_gpu for x in load_pods(without)] == [1, 0]


@pytest.mark.parametrize(("row", "message"), [
    ("p,4000,1024,1,1500", "gpu_milli is 1500, must be between 0 and 1000"),
    ("p,4000,1024,2,500", "a share below one GPU is only valid for num_gpu 1"),
    ("p,4000,1024,0,300", "gpu_milli is 300 but num_gpu is 0"),
    ("p,four,1024,1,500", "cpu_milli is 'four', not a number"),
    ("p,4000,1024", "3 column(s), expected at least 5"),
    ("p,-1,1024,1,500", "cpu_milli is -1, must be at least 0"),
])
def test_bad_pod_rows_name_file_line_and_problem(tmp_path, row, message):
    p = _write(tmp_path, "bad.csv", f"name,cpu_milli,memory_mib,num_gpu,gpu_milli\nok,1,1,1,1000\n{row}\n")
    with pytest.raises(TraceError) as e:
        load_pods(p)
    assert str(e.value).startswith(f"{p}:3: ")
    assert message in str(e.value)


def test_bad_node_rows(tmp_path):
    p = _write(tmp_path, "n.csv", "sn,cpu_milli,memory_mib,gpu,model\nn1,1000,1000,2,H200X\n")
    with pytest.raises(TraceError, match=r"n.csv:2: unknown GPU model 'H200X' \(known: V100M16"):
        load_nodes(p)
    p = _write(tmp_path, "dup.csv", "sn,cpu_milli,memory_mib,gpu,model\nn1,1,1,1,T4\nn1,1,1,1,T4\n")
    with pytest.raises(TraceError, match="dup.csv:3: node 'n1' already listed on line 2"):
        load_nodes(p)
    p = _write(tmp_path, "hdr.csv", "sn,cpu,memory_mib,gpu,model\nn1,1,1,1,T4\n")
    with pytest.raises(TraceError, match=r"hdr.csv:1: header lacks column\(s\) cpu_milli"):
        load_nodes(p)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_pods(tmp_path / "nope.csv")


@pytest.mark.skipif(not OPENB.exists(), reason="openb data not present")
def test_the_shipped_openb_trace_loads():
    nodes = load_nodes(OPENB / "openb_node_list_gpu_node.csv")
    pods = load_pods(OPENB / "openb_pod_list_default.csv")
    assert (len(nodes), sum(n.gpus for n in nodes), len(pods)) == (1213, 6212, 8152)
