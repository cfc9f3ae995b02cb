"""The CDI spec of a claim: its content, its minimum cdiVersion, and its files in the CDI directory.

Every spec built here is validated against the schema written from the CDI specification
(cdischema.py); tests/containers proves a real runtime applies them.
"""

from __future__ import annotations

import copy
import json
import os
import stat

import pytest

from cdischema import errors, validate
from tessera.shared.events import DeviceShare, GpuDevice

from tessera.enforcer import cdi
from tessera.enforcer.claimdir import CONTAINER_LIBVGPU, ClaimDirs
from tessera.enforcer.limits import vgpu_config, workload_env

UUID0 = "GPU-5e55e7a0-0000-4000-8000-000000000000"
UUID1 = "GPU-5e55e7a0-0000-4000-8000-000000000001"
SHARES = [DeviceShare(uuid=UUID1, index=1, memory_mib=2048, cores=50),
          DeviceShare(uuid=UUID0, index=0, memory_mib=1024, cores=50)]
GPUS = {u: GpuDevice(uuid=u, index=i, model="Sim H100", memory_mib=81920, sm_count=132)
        for i, u in enumerate((UUID0, UUID1))}


@pytest.fixture
def prepared(tmp_path):
    """A claim directory as the enforcer's prepare leaves it, and the node's files."""
    directory = ClaimDirs(tmp_path / "state").of("c-0123abcd")
    directory.create(workload_env(SHARES, directory.cache), vgpu_config(SHARES, directory.cache))
    driver = tmp_path / "sim"
    driver.mkdir()
    for lib in cdi.SIM_DRIVER_LIBS:
        (driver / lib).write_bytes(b"\x7fELF")
    return directory, cdi.NodeFiles(libvgpu=tmp_path / "libvgpu.so", sim_driver_dir=str(driver))


def mounts_by_target(spec: dict) -> dict[str, dict]:
    return {m["containerPath"]: m for m in spec["devices"][0]["containerEdits"]["mounts"]}


def env_of(spec: dict) -> dict[str, str]:
    return dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])


def test_simulated_claim_spec_mounts_enforcement_and_needs_only_0_3_0(prepared):
    directory, node = prepared
    spec = cdi.claim_spec("c-0123abcd", SHARES, directory, node, GPUS)
    validate(spec)
    assert spec["cdiVersion"] == "0.3.0"
    assert spec["kind"] == "gpu.tessera.dev/gpu"
    assert cdi.device_ids(spec) == ["gpu.tessera.dev/gpu=c-0123abcd"]
    mounts = mounts_by_target(spec)
    assert mounts[CONTAINER_LIBVGPU]["hostPath"] == str(node.libvgpu)
    assert mounts["/etc/ld.so.preload"]["hostPath"] == str(directory.preload)
    assert mounts["/etc/tessera/vgpu.conf"]["hostPath"] == str(directory.config)
    for target in (CONTAINER_LIBVGPU, "/etc/ld.so.preload", "/etc/tessera/vgpu.conf",
                   "/usr/lib/libcuda.so.1", "/usr/lib/libnvidia-ml.so.1"):
        assert "ro" in mounts[target]["options"] and "bind" in mounts[target]["options"], target
    # The accounting file itself, writable, where the limits file says the cache is.
    cache = mounts[str(directory.cache)]
    assert cache["hostPath"] == str(directory.cache) and "rw" in cache["options"]
    assert [m for m in mounts.values() if "rw" in m["options"]] == [cache]  # nothing else is writable
    limits = directory.config.read_text().splitlines()
    assert f"CUDA_DEVICE_MEMORY_SHARED_CACHE={directory.cache}" in limits
    # ... and names the GPUs its limits' indices refer to, in that order, so libvgpu follows the UUID.
    assert f"CUDA_VISIBLE_DEVICES={UUID0},{UUID1}" in limits
    assert limits.index(f"CUDA_VISIBLE_DEVICES={UUID0},{UUID1}") < limits.index("CUDA_DEVICE_MEMORY_LIMIT_0=1024m")
    assert "deviceNodes" not in spec["devices"][0]["containerEdits"]  # simulated hardware has none


def test_claim_spec_environment_is_hamis_plus_the_simulated_drivers(prepared):
    directory, node = prepared
    env = env_of(cdi.claim_spec("c-0123abcd", SHARES, directory, node, GPUS))
    assert env["CUDA_VISIBLE_DEVICES"] == f"{UUID0},{UUID1}"
    # The spec brings the driver itself: an NVIDIA runtime on the node must inject nothing more.
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m" and env["CUDA_DEVICE_MEMORY_LIMIT_1"] == "2048m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "50"
    assert env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == str(directory.cache)
    assert env["LD_PRELOAD"] == CONTAINER_LIBVGPU
    assert env["TESSERA_SIM_GPU_UUIDS"] == f"{UUID0},{UUID1}" and env["TESSERA_SIM_GPU_COUNT"] == "2"
    assert env["TESSERA_SIM_GPU_MEMORY_MIB"] == "81920"
    # Host paths that mean nothing in a container are not passed on.
    assert "LD_LIBRARY_PATH" not in env and "TESSERA_VGPU_CONFIG" not in env


def test_claim_files_a_container_gets_cannot_be_written_by_others(prepared):
    directory, _ = prepared
    for path in (directory.config, directory.preload):
        assert stat.S_IMODE(path.stat().st_mode) == 0o444, path
    assert directory.preload.read_text() == CONTAINER_LIBVGPU + "\n"
    # Container layout: the file is writable by whatever uid the container runs as, and no host user
    # reaches it, because the claim's directory is the enforcer's alone.
    assert stat.S_IMODE(directory.cache.stat().st_mode) == 0o666
    assert stat.S_IMODE(directory.path.stat().st_mode) == 0o700


def test_real_node_spec_names_the_gpus_and_drivers_device_nodes_with_the_hosts_numbers(tmp_path, prepared):
    directory, _ = prepared
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia1", "nvidiactl", "nvidia-uvm-tools"):  # no nvidia0 and no nvidia-uvm on this "host"
        (dev / name).symlink_to("/dev/null")
    null = os.stat("/dev/null").st_rdev
    spec = cdi.claim_spec("c-0123abcd", SHARES, directory, cdi.NodeFiles(libvgpu="/opt/libvgpu.so", dev_root=dev))
    validate(spec)
    assert spec["cdiVersion"] == "0.3.0"  # path only (no hostPath): nothing newer is needed
    nodes = {n["path"]: n for n in spec["devices"][0]["containerEdits"]["deviceNodes"]}
    assert list(nodes) == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    # An allocated GPU or a driver node that is missing is still named, so the container fails to
    # start instead of running without it; the others carry the host's numbers.
    assert nodes["/dev/nvidia0"] == {"path": "/dev/nvidia0"} and nodes["/dev/nvidia-uvm"] == {"path": "/dev/nvidia-uvm"}
    for path in ("/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm-tools"):
        assert (nodes[path]["type"], nodes[path]["major"], nodes[path]["minor"]) == ("c", os.major(null),
                                                                                     os.minor(null))
    (dev / "nvidia-uvm-tools").unlink()  # optional: named only where the host has it
    again = cdi.claim_spec("c-0123abcd", SHARES, directory, cdi.NodeFiles(libvgpu="/opt/libvgpu.so", dev_root=dev))
    assert "/dev/nvidia-uvm-tools" not in [n["path"] for n in again["devices"][0]["containerEdits"]["deviceNodes"]]
    assert not any(m["containerPath"].startswith("/usr/lib/") for m in mounts_by_target(spec).values())
    assert not any(e.startswith("TESSERA_SIM_") for e in spec["devices"][0]["containerEdits"]["env"])


def test_a_claim_without_devices_has_no_spec(prepared):
    directory, node = prepared
    with pytest.raises(ValueError, match="no devices"):
        cdi.claim_spec("c-0123abcd", [], directory, node)


# --- device names -------------------------------------------------------------------------------


@pytest.mark.parametrize("claim", ["c-0123abcd", "run-9f", "k8s-1b4e28ba-2fa1-11d2-883f-0016d3cca427", "A_b-c"])
def test_a_valid_claim_id_is_its_own_device_name(claim):
    assert cdi.device_name(claim) == claim


def test_claim_ids_the_name_rule_refuses_get_distinct_valid_names():
    names = {cdi.device_name(c) for c in ("_x", "x_", "x-", "-x", "__", "x")}
    assert len(names) == 6
    for name in names:
        assert not errors({"cdiVersion": "0.3.0", "kind": cdi.KIND, "devices": [{"name": name}]}), name
    with pytest.raises(ValueError):
        cdi.device_name("")


def test_a_claim_id_starting_with_a_digit_needs_0_5_0(prepared):
    directory, node = prepared
    spec = cdi.claim_spec("0abc", SHARES, directory, node, GPUS)
    assert spec["devices"][0]["name"] == "0abc" and spec["cdiVersion"] == "0.5.0"
    validate(spec)


# --- the minimum cdiVersion: the specification's version table ----------------------------------

BASE = {"cdiVersion": "", "kind": "vendor.example/dev",
        "devices": [{"name": "d0", "containerEdits": {"env": ["A=1"]}}]}


def with_edit(**edit):
    def apply(spec):
        spec["devices"][0]["containerEdits"].update(edit)
    return apply


def at_spec_level(**edit):
    def apply(spec):
        spec["containerEdits"] = dict(edit)
    return apply


def setter(key, value, device=False):
    def apply(spec):
        (spec["devices"][0] if device else spec)[key] = value
    return apply


FEATURES = [
    ("nothing newer", lambda s: None, "0.3.0"),
    # Hooks are in the first tagged release (0.3.0): the driver's ldcache hook raises nothing.
    ("createContainer hook", with_edit(hooks=[{"hookName": "createContainer", "path": "/bin/h", "args": ["h"]}]),
     "0.3.0"),
    ("mount type", with_edit(mounts=[{"hostPath": "/a", "containerPath": "/b", "type": "bind"}]), "0.4.0"),
    ("empty mount type", with_edit(mounts=[{"hostPath": "/a", "containerPath": "/b", "type": ""}]), "0.3.0"),
    ("device node hostPath", with_edit(deviceNodes=[{"path": "/dev/x", "hostPath": "/dev/y"}]), "0.5.0"),
    ("spec-level hostPath", at_spec_level(deviceNodes=[{"path": "/dev/x", "hostPath": "/dev/y"}]), "0.5.0"),
    ("device name starting with a digit", setter("name", "0d", device=True), "0.5.0"),
    ("spec annotations", setter("annotations", {"a": "b"}), "0.6.0"),
    ("device annotations", setter("annotations", {"a": "b"}, device=True), "0.6.0"),
    ("dot in the kind's name", setter("kind", "vendor.example/dev.x"), "0.6.0"),
    ("intelRdt", with_edit(intelRdt={"closID": "c"}), "0.7.0"),
    ("additionalGids", at_spec_level(additionalGids=[5]), "0.7.0"),
    ("netDevices", with_edit(netDevices=[{"hostInterfaceName": "eth1", "name": "net1"}]), "1.1.0"),
    ("intelRdt schemata", at_spec_level(intelRdt={"schemata": ["L3:0=f"]}), "1.1.0"),
    ("intelRdt monitoring", with_edit(intelRdt={"enableMonitoring": True}), "1.1.0"),
]


@pytest.mark.parametrize("feature, apply, version", FEATURES, ids=[f[0] for f in FEATURES])
def test_min_version_is_the_newest_version_a_used_feature_needs(feature, apply, version):
    spec = copy.deepcopy(BASE)
    apply(spec)
    assert cdi.min_version(spec) == version
    # The schema, written separately from the same table, agrees: valid at that version, not below it.
    spec["cdiVersion"] = version
    validate(spec)
    earlier = cdi.VERSIONS[: cdi.VERSIONS.index(version)]
    if earlier:
        spec["cdiVersion"] = earlier[-1]
        assert errors(spec), f"{feature} accepted by the schema at {earlier[-1]}"


def test_min_version_takes_the_newest_of_several_features():
    spec = copy.deepcopy(BASE)
    with_edit(mounts=[{"hostPath": "/a", "containerPath": "/b", "type": "bind"}])(spec)
    setter("annotations", {"a": "b"})(spec)
    assert cdi.min_version(spec) == "0.6.0"


def test_schema_refuses_what_the_specification_does_not_allow():
    good = dict(copy.deepcopy(BASE), cdiVersion="0.3.0")
    validate(good)
    bad = {
        "unknown field": dict(good, vendorExtra=1),
        "kind without a prefix": dict(good, kind="dev"),
        "kind with two names": dict(good, kind="vendor.example/a/b"),
        "no devices": dict(good, devices=[]),
        "device name with a slash": dict(good, devices=[{"name": "a/b"}]),
        "env without =": dict(good, containerEdits={"env": ["NOVALUE"]}),
        "relative hook path": dict(good, containerEdits={"hooks": [{"hookName": "createContainer", "path": "x"}]}),
        "unknown hook name": dict(good, containerEdits={"hooks": [{"hookName": "preStart", "path": "/x"}]}),
        "unknown version": dict(good, cdiVersion="0.9.0"),
        "bad permissions": dict(good, containerEdits={"deviceNodes": [{"path": "/dev/x", "permissions": "rx"}]}),
    }
    for what, spec in bad.items():
        assert errors(spec), what


# --- files in the CDI directory -----------------------------------------------------------------


def test_write_spec_writes_one_file_per_claim_atomically(tmp_path, prepared):
    directory, node = prepared
    cdi_dir = tmp_path / "cdi"
    spec = cdi.claim_spec("c-0123abcd", SHARES, directory, node, GPUS)
    path = cdi.write_spec(cdi_dir, spec)
    assert path == cdi.spec_path(cdi_dir, "c-0123abcd") == cdi_dir / "gpu.tessera.dev-gpu_c-0123abcd.json"
    assert json.loads(path.read_text()) == spec
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert cdi.write_spec(cdi_dir, spec) == path  # rewriting (a repeated prepare) replaces it
    assert sorted(p.name for p in cdi_dir.iterdir()) == [path.name]


def test_a_failed_write_leaves_the_previous_spec_and_no_temporary_file(tmp_path, prepared, monkeypatch):
    directory, node = prepared
    cdi_dir = tmp_path / "cdi"
    spec = cdi.claim_spec("c-0123abcd", SHARES, directory, node, GPUS)
    path = cdi.write_spec(cdi_dir, spec)
    before = path.read_text()

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cdi.os, "fsync", broken_fsync)
    changed = dict(spec, devices=[dict(spec["devices"][0], containerEdits={"env": ["A=1"]})])
    with pytest.raises(OSError, match="No space"):
        cdi.write_spec(cdi_dir, changed)
    assert path.read_text() == before
    assert sorted(p.name for p in cdi_dir.iterdir()) == [path.name]


def test_write_spec_refuses_what_is_not_one_claims_spec(tmp_path):
    with pytest.raises(ValueError, match="one device"):
        cdi.write_spec(tmp_path, dict(BASE, kind=cdi.KIND, devices=[]))
    with pytest.raises(ValueError, match="kind"):
        cdi.write_spec(tmp_path, dict(BASE))
    with pytest.raises(ValueError, match="not valid"):
        cdi.write_spec(tmp_path, dict(BASE, kind=cdi.KIND, devices=[{"name": "_x"}]))
    assert list(tmp_path.iterdir()) == []


def test_remove_spec_is_idempotent(tmp_path, prepared):
    directory, node = prepared
    cdi_dir = tmp_path / "cdi"
    cdi.write_spec(cdi_dir, cdi.claim_spec("c-0123abcd", SHARES, directory, node, GPUS))
    assert cdi.remove_spec(cdi_dir, "c-0123abcd") is True
    assert cdi.remove_spec(cdi_dir, "c-0123abcd") is False
    assert list(cdi_dir.iterdir()) == []
