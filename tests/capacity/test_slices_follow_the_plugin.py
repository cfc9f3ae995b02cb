"""A node's ResourceSlice is written only while the kubelet has the node's DRA plugin registered, as
the node's enforcer says on the bus: the kubelet deletes the slices of a plugin that went, and the
publisher must not put them back until the plugin is registered again (defect 9 of issue 22).
The kubelet itself is in tests/kubernetes/test_real_plugin_slices.py; here the rules, on their own
clock, and the service's decisions, with a writer that records what it is asked to write."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from tessera.shared.events import GpuDevice, KubeletPluginStatus, NodeInventory

from tessera.capacity.plugins import KubeletPlugins
from tessera.capacity.service import CapacityService
from tessera.capacity.settings import CapacitySettings


def node(name: str) -> NodeInventory:
    return NodeInventory(node=name, devices=[GpuDevice(uuid=f"GPU-{name}-0", index=0, model="NVIDIA H100 80GB HBM3",
                                                       memory_mib=81559)])


def said(node: str, registered: bool, instance: str = "pod-1", reason: str = "") -> KubeletPluginStatus:
    return KubeletPluginStatus(node=node, instance=instance, registered=registered, reason=reason)


def test_a_plugin_counts_as_registered_while_one_instance_says_so_and_is_not_silent():
    plugins = KubeletPlugins(silent_after=15)
    assert "has not said" in plugins.why_not("a", 100)
    plugins.heard(said("a", True), 100)
    assert plugins.registered("a", 110) and plugins.registered("a", 115)
    assert "silent for 16s" in plugins.why_not("a", 116)  # died without a word
    # a rolling update: the new instance registers before the old one stops
    plugins.heard(said("a", True, "pod-2"), 120)
    plugins.heard(said("a", False, "pod-1", "the plugin stopped"), 121)
    assert plugins.registered("a", 122)
    plugins.heard(said("a", False, "pod-2", "the plugin stopped"), 123)
    assert plugins.why_not("a", 124) == "its kubelet plugin is not registered (the plugin stopped)"
    assert not plugins.registered("b", 124)  # nodes are apart


class Recorder:
    def __init__(self) -> None:
        self.published: list[str] = []

    async def publish(self, inv: NodeInventory, current=None):
        self.published.append(inv.node)
        return 1


async def test_the_slice_is_written_while_the_plugin_is_registered_and_left_alone_while_not(caplog):
    caplog.set_level(logging.INFO, "tessera.capacity")
    writer = Recorder()
    svc = CapacityService(SimpleNamespace(bus=None), CapacitySettings(kubernetes=True), [node("a"), node("b")],
                          slices=writer)
    await svc._publish_slices()
    assert writer.published == [] and svc.slices_due == {"a", "b"}  # no plugin registered yet
    assert "ResourceSlice of a not written: its kubelet plugin has not said" in caplog.text

    await svc._plugin_said(said("a", True, reason="registered by the kubelet"))
    assert writer.published == ["a"] and svc.slices_due == {"b"}

    await svc._plugin_said(said("a", False, reason="the plugin stopped"))
    await svc._slice_changed("a")  # the kubelet wiped it: the watch sees it go
    await svc._publish_slices(verify=False)  # and a heartbeat
    assert writer.published == ["a"] and "a" in svc.slices_due

    await svc._plugin_said(said("a", True, instance="pod-2", reason="registered by the kubelet"))
    assert writer.published == ["a", "a"]  # back as soon as it is registered again
    assert "ResourceSlice of a written again" in caplog.text


async def test_without_a_kubelet_the_slices_are_written_regardless():
    writer = Recorder()
    svc = CapacityService(SimpleNamespace(bus=None), CapacitySettings(kubernetes=True, slices_need_plugin=False),
                          [node("a")], slices=writer)
    await svc._publish_slices()
    assert writer.published == ["a"]
