"""Each GPU's health as the hardware says it now, read again at every heartbeat.

Discovery (discovery.py) reads the fleet once; a GPU can fail or fall off the bus afterwards. This
reads, per GPU UUID, whether it is healthy now: on real hardware NVML (a GPU it can no longer
query is lost), on simulated hardware the profile file (parsed again only when it changed: editing a
GPU's ``healthy`` there is how a simulated GPU fails or recovers). A GPU the answer does not name
any more counts as lost, so unhealthy. The publisher announces the change (placement stops using
the GPU, the kubelet's health stream says so) and taints the GPU's device in its ResourceSlice.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.shared import profile as profiles
from tessera.shared.errors import ConfigError

if TYPE_CHECKING:
    from tessera.capacity.settings import CapacitySettings

log = logging.getLogger("tessera.capacity.health")


class HealthSource:
    def __init__(self, settings: CapacitySettings) -> None:
        self.settings = settings
        self._text: bytes | None = None  # the profile last read
        self._found: dict[str, bool] | None = None  # and what it said

    def read(self, uuids: list[str]) -> dict[str, bool] | None:
        """uuid -> healthy now, for ``uuids``; None when it cannot be told (a profile that was
        never readable). An unchanged profile is not parsed again; one that cannot be read now
        (half-written, say) leaves what it said last."""
        if self.settings.discovery == "nvml":
            from tessera.capacity.nvml import device_health

            return device_health(uuids)
        text: bytes | None
        try:
            text = Path(self.settings.profile).read_bytes()
        except OSError as exc:
            log.warning("profile %s not read for GPU health: %s", self.settings.profile, exc.strerror)
            text = self._text
        if text is not None and text != self._text:
            self._text = text
            try:
                nodes = profiles.parse(text, self.settings.profile)
            except ConfigError as exc:  # half-written or broken: the health last read stands
                log.warning("profile not read for GPU health (read again when it changes): %s", exc)
            else:
                self._found = {d.uuid: d.healthy for n in nodes for d in n.devices}
        if self._found is None:
            return None
        return {u: self._found.get(u, False) for u in uuids}
