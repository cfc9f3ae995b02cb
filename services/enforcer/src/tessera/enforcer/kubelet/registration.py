"""Whether the kubelet has this node's DRA plugin registered, said on the bus for the capacity publisher.

The kubelet deletes a node's ResourceSlices of a driver 30 s after the driver's plugin goes (its
"driver is down" signal: the registration socket gone, or the plugin's connection lost), so that no
pod is sent to a node that cannot prepare its claims. The capacity publisher writes those slices and
must not put them back meanwhile; it learns of the plugin only from the bus. So the plugin says what
it knows (`KubeletPluginStatus` on ``tessera.usage.<node>``): registered when the kubelet's
NotifyRegistrationStatus says so or the kubelet calls it (it calls only a registered plugin), not
registered when the kubelet refused it, when its registration socket is gone, and when it stops. It
says so at each change and, while registered, again every ``report_seconds``: a plugin that dies
without a word falls silent, and the capacity publisher counts a silent plugin as gone. The first
registration may also open the enforcer's readiness (``on_registered``): a rolling update stops the
old instance once the new pod is Ready, which then means the kubelet already has the new one.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Awaitable, Callable

from tessera.shared.events import KubeletPluginStatus

log = logging.getLogger("tessera.enforcer.kubelet")

REPORT_SECONDS = 5.0
LAST_WORD_SECONDS = 2.0  # how long a stopping plugin tries to say it is going


class PluginRegistration:
    def __init__(self, node: str, instance: str, publish: Callable[[KubeletPluginStatus], Awaitable[None]],
                 report_seconds: float = REPORT_SECONDS, on_registered: Callable[[], None] | None = None) -> None:
        self.node = node
        self.instance = instance
        self.publish = publish
        self.report_seconds = report_seconds
        # called once, the first time the kubelet has it registered (the readiness gate of
        # TESSERA_KUBELET_READY_WHEN_REGISTERED)
        self.on_registered = on_registered
        self.registered = False
        self.reason = "the kubelet has not registered the plugin yet"
        self.socket: Path | None = None  # the registration socket, once it is there
        self._changed = asyncio.Event()

    def status(self) -> KubeletPluginStatus:
        return KubeletPluginStatus(node=self.node, instance=self.instance, registered=self.registered,
                                   reason=self.reason)

    def _set(self, registered: bool, reason: str) -> None:
        """Note it; said at once when it is news (registered or not, or another reason why not)."""
        news = registered != self.registered or (not registered and reason != self.reason)
        self.registered, self.reason = registered, reason
        if news:
            self._changed.set()
        if registered and self.on_registered is not None:
            self.on_registered()
            self.on_registered = None

    def notified(self, registered: bool, error: str = "") -> None:
        """The kubelet's NotifyRegistrationStatus."""
        self._set(registered, "registered by the kubelet" if registered
                  else f"the kubelet refused to register it: {error or 'no reason given'}")

    def called(self, what: str) -> None:
        """The kubelet called the plugin (``what``): it has it registered."""
        self._set(True, f"the kubelet called {what}")

    def listening(self, socket: Path) -> None:
        self.socket = socket

    async def report(self) -> None:
        """Forever: the status at each change, and while registered every ``report_seconds``."""
        while True:
            if self.registered and self.socket is not None and not self.socket.exists():
                self._set(False, f"its registration socket {self.socket} is gone: the kubelet unregisters it")
            self._changed.clear()
            status = self.status()
            try:
                await self.publish(status)
            except Exception as exc:  # NATS away: said again at the next turn
                log.warning("kubelet plugin status not published (said again in %.0fs): %r", self.report_seconds, exc)
            if not self._changed.is_set():
                # (a long wait while not registered: there is nothing to keep alive)
                timeout = self.report_seconds if status.registered else self.report_seconds * 6
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout)
                except TimeoutError:
                    pass

    async def stopped(self) -> None:
        """The plugin's sockets are gone: say it is not registered any more (best effort, briefly)."""
        self.registered, self.reason = False, "the plugin stopped"
        try:
            await asyncio.wait_for(self.publish(self.status()), LAST_WORD_SECONDS)
        except Exception as exc:  # its silence says the same, a little later
            log.warning("could not say that the kubelet plugin stopped: %r", exc)
