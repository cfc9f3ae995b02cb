"""Which nodes have their kubelet plugin registered: when the capacity publisher may write their slices.

The kubelet deletes a node's ResourceSlices of a driver once the driver's plugin has been gone for
30 s (and all of them when it starts), so that no pod goes to a node that cannot prepare its claims.
A slice written back meanwhile would undo that. The enforcer, the plugin, says on the bus whether the
kubelet has it registered (`KubeletPluginStatus`, one per instance: a rolling update runs two), at
each change and every few seconds while registered. A node's plugin counts as registered while one
instance's last word says so and is younger than ``silent_after`` (a plugin that died says nothing;
kept below the kubelet's 30 s, so the publisher has let go before the kubelet wipes).

Remembered, not stored: a restarted publisher hears every registered plugin within one report, and
until then writes nothing (the slices already there stay; the kubelet's rules still hold).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.shared.events import KubeletPluginStatus

FORGET_AFTER = 20  # an instance silent for this many times ``silent_after`` is forgotten


@dataclass(frozen=True)
class Heard:
    registered: bool
    reason: str
    at: float  # when it was heard, by this publisher's clock


class KubeletPlugins:
    def __init__(self, silent_after: float) -> None:
        self.silent_after = silent_after
        self.instances: dict[str, dict[str, Heard]] = {}  # node -> instance -> its last word

    def heard(self, status: KubeletPluginStatus, now: float) -> None:
        instances = self.instances.setdefault(status.node, {})
        instances[status.instance] = Heard(status.registered, status.reason, now)
        for name, h in list(instances.items()):  # the instances a rolling update left behind
            if now - h.at > FORGET_AFTER * self.silent_after:
                del instances[name]

    def registered(self, node: str, now: float) -> bool:
        return self.why_not(node, now) is None

    def why_not(self, node: str, now: float) -> str | None:
        """Why ``node``'s plugin does not count as registered now (None: it does)."""
        heard = self.instances.get(node) or {}
        if any(h.registered and now - h.at <= self.silent_after for h in heard.values()):
            return None
        if not heard:
            return "its kubelet plugin has not said that the kubelet registered it"
        last = max(heard.values(), key=lambda h: h.at)
        if last.registered:
            return f"its kubelet plugin has been silent for {now - last.at:.0f}s"
        return f"its kubelet plugin is not registered ({last.reason})"
