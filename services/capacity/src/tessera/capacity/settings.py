"""The capacity publisher's settings, declared field by field (`tessera.shared.settings`).

Which fleet it announces (a profile's nodes, or this machine's GPUs), how often each node's
heartbeat goes out, and how long a node or its enforcer may be silent before it counts as lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tessera.shared.errors import ConfigError
from tessera.shared.settings import FromEnv, node_name, setting


@dataclass(frozen=True, kw_only=True)
class CapacitySettings(FromEnv):
    discovery: str = setting(
        "TESSERA_DISCOVERY", "`profile`: the fleet described by a profile file (simulated hardware); `nvml`: this "
        "machine's GPUs through NVML", "profile", choices=("profile", "nvml"))
    profile: str = setting(
        "TESSERA_PROFILE", "the fleet profile (with `TESSERA_DISCOVERY=profile`)", "profiles/demo.yaml")
    nodes: tuple[str, ...] = setting(
        "TESSERA_CAPACITY_NODES", "comma-separated nodes of the profile this publisher serves", (),
        shown="every node")
    node: str | None = setting("TESSERA_NODE", "the node name with `TESSERA_DISCOVERY=nvml`", None,
                               parse=node_name, shown="the host name")
    heartbeat_seconds: float = setting("TESSERA_HEARTBEAT_SECONDS", "heartbeat period of each node", 5.0)
    lost_after_seconds: float = setting(
        "TESSERA_LOST_AFTER_SECONDS", "a node whose heartbeat is silent this long is labelled lost (placement skips "
        "it; a peer enforcer releases its claims)", 20.0)
    # A node whose enforcer has reported before and then fell silent this long is lost too: its
    # GPUs may still be announced, but nobody there can prepare or release a claim.
    enforcer_lost_after_seconds: float = setting(
        "TESSERA_ENFORCER_LOST_AFTER_SECONDS", "the same when the node's enforcer stops reporting usage", 90.0)
    # Publish each node's GPUs as a DRA ResourceSlice too (a Kubernetes cluster's scheduler reads them).
    kubernetes: bool = setting(
        "TESSERA_KUBERNETES", "`true`: also keep each node's DRA ResourceSlice (driver `gpu.tessera.dev`, "
        "consumable `memory`, `cores`, `shares`) current through the Kubernetes API", False)

    # The kubelet deletes a node's slices once its plugin is gone; writing them back would offer GPUs
    # that nothing on the node can prepare.
    slices_need_plugin: bool = setting(
        "TESSERA_SLICES_NEED_PLUGIN", "`true`: a node's ResourceSlice is written only while the node's enforcer "
        "says the kubelet has its DRA plugin registered (the kubelet deletes it when the plugin goes); `false`: "
        "always (nodes without a kubelet: a simulated fleet, a benchmark)", True)
    plugin_silent_after_seconds: float = setting(
        "TESSERA_PLUGIN_SILENT_AFTER_SECONDS", "a kubelet plugin not heard from for this long counts as gone (it "
        "reports every 5 s; keep this under the kubelet's 30 s before it deletes the slices)", 15.0, above=5)

    def check(self) -> Iterable[str]:
        """The fleet is read before connecting: a bad profile fails fast, naming the path."""
        from tessera.capacity.discovery import discover

        try:
            discover(self)
        except ConfigError as exc:
            yield str(exc)
