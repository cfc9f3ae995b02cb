"""The attributes DRA users select on, as the capacity publisher writes them into a ResourceSlice:
present where discovery (a profile or NVML) knows them, valid as the API server validates them."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest

from tessera.capacity import slices
from tessera.shared import profile
from tessera.shared.events import GpuDevice, NodeInventory
from tessera.shared.profile import ProfileError

# resource.k8s.io/v1 QualifiedName without a domain: a C identifier of at most 32 characters.
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")
# semver.org 2.0.0, the format of a `version` attribute (no leading zeros).
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")


def check_device(device: dict) -> None:
    """The rules of resource.k8s.io/v1 a schema does not carry: names, one value, lengths, semver,
    at most 32 attributes and capacities together, request policies that fit their capacity."""
    assert len(device["attributes"]) + len(device["capacity"]) <= 32
    for name, value in device["attributes"].items():
        assert C_IDENTIFIER.match(name), name
        (kind, v), = value.items()
        assert kind in ("int", "bool", "string", "version")
        if kind in ("string", "version"):
            assert len(v) <= 64
        if kind == "version":
            assert SEMVER.match(v), (name, v)
    for name, cap in device["capacity"].items():
        assert C_IDENTIFIER.match(name), name
        policy = cap.get("requestPolicy")
        if policy is None:
            continue
        assert device["allowMultipleAllocations"] is True  # a policy needs a shareable device
        value, default = _quantity(cap["value"]), _quantity(policy["default"])
        assert ("validValues" in policy) != ("validRange" in policy)
        if "validValues" in policy:
            values = [_quantity(v) for v in policy["validValues"]]
            assert values == sorted(values) and default in values and len(values) <= 10
        else:
            rng = policy["validRange"]
            low, high = _quantity(rng["min"]), _quantity(rng.get("max", cap["value"]))
            step = _quantity(rng.get("step", "1"))
            assert 0 <= low <= default <= high <= value
            assert default % step == 0 and high % step == 0 and low + step <= value


def _quantity(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def test_the_demo_profiles_gpus_carry_the_attributes_and_policies_dra_users_select_on():
    fleet = profile.load("profiles/demo.yaml")
    h100 = slices.resource_slice(fleet[0], 1)
    kubernetes_validate.validate(h100, "1.34", strict=True)
    for device in h100["spec"]["devices"]:
        check_device(device)
    attrs = h100["spec"]["devices"][0]["attributes"]
    assert attrs["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert attrs["architecture"] == {"string": "Hopper"}
    assert attrs["cudaComputeCapability"] == {"version": "9.0.0"}
    assert attrs["driverVersion"] == {"version": "580.65.6"}  # NVIDIA's "580.65.06" has a leading zero
    assert attrs["uuid"]["string"].startswith("GPU-") and attrs["index"] == {"int": 0}
    a100 = slices.resource_slice(fleet[-1], 1)["spec"]["devices"][0]
    assert a100["attributes"]["cudaComputeCapability"] == {"version": "8.0.0"}
    assert a100["attributes"]["architecture"] == {"string": "Ampere"}
    # 40960Mi as the API server spells it back: comparing with what was read sees no change
    assert a100["capacity"]["memory"]["value"] == a100["capacity"]["memory"]["requestPolicy"]["default"] == "40Gi"


@pytest.mark.parametrize("mib, text", [(81559, "81559Mi"), (40960, "40Gi"), (8000, "8000Mi"), (1024, "1Gi"),
                                       (1048576, "1Ti"), (1536, "1536Mi")])
def test_memory_is_written_in_the_api_servers_canonical_form(mib, text):
    assert slices.mebibytes(mib) == text


def test_what_discovery_does_not_know_is_left_out_and_nonsense_never_reaches_the_slice():
    gpu = GpuDevice(uuid="GPU-1", index=3, model="X" * 80, memory_mib=1024, driver_version="r580-beta",
                    pci_bus_id="00000000:17:00.0")
    doc = slices.resource_slice(NodeInventory(node="n", devices=[gpu]), 1)
    kubernetes_validate.validate(doc, "1.34", strict=True)
    (device,) = doc["spec"]["devices"]
    check_device(device)
    attrs = device["attributes"]
    assert "architecture" not in attrs and "cudaComputeCapability" not in attrs
    assert "driverVersion" not in attrs  # not a version: left out rather than refused by the API server
    assert attrs["pciBusID"] == {"string": "00000000:17:00.0"}
    assert attrs["productName"] == {"string": "X" * 64}  # DRA's limit on a string value


@pytest.mark.parametrize("given, semver", [("9.0", "9.0.0"), ("580.65.06", "580.65.6"), ("12", "12.0.0"),
                                           ("535.104.05", "535.104.5"), ("1.2.3.4", None), ("", None), ("9.x", None)])
def test_versions_become_semver(given, semver):
    assert slices.semver(given) == semver


def test_a_profile_with_a_malformed_attribute_names_the_field():
    bad = ("nodes:\n  - name: n0\n    gpus:\n      - {model: L4, memory_mib: 1000, compute_capability: 'nine'}\n")
    with pytest.raises(ProfileError, match=r"compute_capability"):
        profile.parse(bad)
    good = ("nodes:\n  - name: n0\n    gpus:\n      - {model: L4, memory_mib: 1000, compute_capability: '8.9',"
            " pci_bus_id: '00000000:3b:00.0', architecture: Ada Lovelace}\n")
    (node,) = profile.parse(good)
    assert node.devices[0].pci_bus_id == "00000000:3b:00.0" and node.devices[0].compute_capability == "8.9"


def test_nvml_facts_are_read_where_the_driver_gives_them_and_left_empty_where_not(monkeypatch):
    # (no GPU here: NVML's answers as a Hopper card on driver 580 gives them, then an older driver's)
    import pynvml

    from tessera.capacity import nvml

    monkeypatch.setattr(pynvml, "nvmlDeviceGetArchitecture", lambda h: pynvml.NVML_DEVICE_ARCH_HOPPER)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCudaComputeCapability", lambda h: (9, 0))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPciInfo", lambda h: type("Pci", (), {"busId": b"00000000:17:00.0"})())
    facts = nvml._facts(object(), "580.65.06")
    assert facts == {"architecture": "Hopper", "compute_capability": "9.0", "driver_version": "580.65.06",
                     "pci_bus_id": "00000000:17:00.0"}
    gpu = GpuDevice(uuid="GPU-x", index=0, model="NVIDIA H200", memory_mib=143771, **facts)
    attrs = slices.attributes(gpu)
    assert attrs["architecture"] == {"string": "Hopper"} and attrs["driverVersion"] == {"version": "580.65.6"}

    def unsupported(*_):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    for name in ("nvmlDeviceGetArchitecture", "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetPciInfo"):
        monkeypatch.setattr(pynvml, name, unsupported)
    assert nvml._facts(object(), "") == {"architecture": "", "compute_capability": "", "driver_version": "",
                                         "pci_bus_id": ""}
