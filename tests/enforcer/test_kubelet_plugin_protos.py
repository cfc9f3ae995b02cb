"""The kubelet plugin's generated gRPC modules: current with their .proto files, and the wire names
(packages, services, fields and numbers) the kubelet speaks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATE = REPO / "services" / "enforcer" / "proto" / "generate.py"


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GENERATE), "--check", *args], capture_output=True, text=True)


def test_the_committed_modules_are_generated_from_the_current_protos():
    result = check()
    assert result.returncode == 0, result.stderr


def test_an_edited_proto_makes_the_check_fail(tmp_path):
    protos = tmp_path / "proto"
    shutil.copytree(GENERATE.parent, protos, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    dra = protos / "tessera" / "enforcer" / "kubelet" / "api" / "dra_v1.proto"
    dra.write_text(dra.read_text().replace("string error = 2;", "string error = 2;\n  string hint = 3;", 1))
    result = check("--protos", str(protos))
    assert result.returncode == 1
    assert "dra_v1_pb2.py" in result.stderr and "make protos" in result.stderr


def test_the_services_and_messages_carry_the_kubelets_wire_names():
    from tessera.enforcer.kubelet.api import dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_v1_pb2 as reg

    assert reg.DESCRIPTOR.services_by_name["Registration"].full_name == "pluginregistration.Registration"
    assert [(f.name, f.number) for f in reg.PluginInfo.DESCRIPTOR.fields] == [
        ("type", 1), ("name", 2), ("endpoint", 3), ("supported_versions", 4)]
    assert [(f.name, f.number) for f in reg.RegistrationStatus.DESCRIPTOR.fields] == [
        ("plugin_registered", 1), ("error", 2)]
    v1 = dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert v1.full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert sorted(m.name for m in v1.methods) == ["NodePrepareResources", "NodeUnprepareResources"]
    assert dra_v1beta1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == \
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
    assert [(f.name, f.number) for f in dra_v1_pb2.Device.DESCRIPTOR.fields] == [
        ("request_names", 1), ("pool_name", 2), ("device_name", 3), ("cdi_device_ids", 4), ("share_id", 5)]
    assert [(f.name, f.number) for f in dra_v1_pb2.Claim.DESCRIPTOR.fields] == [
        ("namespace", 1), ("uid", 2), ("name", 3)]
    assert [(f.name, f.number) for f in dra_v1_pb2.NodePrepareResourceResponse.DESCRIPTOR.fields] == [
        ("devices", 1), ("error", 2)]
    assert [f.name for f in dra_v1beta1_pb2.Device.DESCRIPTOR.fields] == [
        "request_names", "pool_name", "device_name", "cdi_device_ids"]
