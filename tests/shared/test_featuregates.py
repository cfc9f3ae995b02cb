"""The consumable-capacity check: a field the gate guards that the server's answer lacks is named,
with the gate and the fix; fields the server merely respelled or added are not a drop."""

from __future__ import annotations

import pytest

from tessera.shared.featuregates import FeatureGateOff, dropped, require_consumable_capacity

SLICE = {"spec": {"devices": [{"name": "gpu-0", "allowMultipleAllocations": True,
                               "capacity": {"memory": {"value": "80Gi", "requestPolicy": {"default": "80Gi"}}}}]}}
TEMPLATE = {"spec": {"spec": {"devices": {"requests": [
    {"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev",
                                "capacity": {"requests": {"memory": "1Gi"}}}}]}}}}


def test_a_server_with_the_gate_keeps_everything():
    stored = {"metadata": {"uid": "x"}, **SLICE}
    assert dropped(SLICE, stored) == []
    require_consumable_capacity("ResourceSlice n", SLICE, stored)


def test_the_dropped_fields_are_named_with_the_gate():
    stored = {"spec": {"devices": [{"name": "gpu-0", "capacity": {"memory": {"value": "80Gi"}}}]}}
    assert dropped(SLICE, stored) == ["spec.devices[0].allowMultipleAllocations",
                                      "spec.devices[0].capacity.memory.requestPolicy"]
    with pytest.raises(FeatureGateOff, match=r"DRAConsumableCapacity feature gate is off.*--feature-gates"):
        require_consumable_capacity("ResourceSlice n", SLICE, stored)


def test_a_request_s_capacity_is_gated_a_device_s_is_not():
    stored = {"spec": {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}]}}}}
    assert dropped(TEMPLATE, stored) == ["spec.spec.devices.requests[0].exactly.capacity"]
    assert dropped({"spec": {"devices": [{"capacity": {}}]}}, {"spec": {"devices": [{}]}}) == []
