"""Where the nodes a capacity publisher serves come from: a fleet profile, or this machine's NVML.

Its own module because two steps ask for it: the settings' check, before anything connects (a broken
profile or a machine without NVML stops the publisher naming the cause), and the service's start,
which gets the nodes that check found (remembered per settings, not read or probed again).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from tessera.shared import profile as profiles
from tessera.shared.errors import ConfigError
from tessera.shared.events import NodeInventory

if TYPE_CHECKING:
    from tessera.capacity.settings import CapacitySettings


def discover(settings: CapacitySettings) -> list[NodeInventory]:
    """The nodes to announce; a ConfigError (a `ProfileError` among them) says what is wrong."""
    return list(_discovered(settings))


@functools.lru_cache(maxsize=4)  # (a failure is not remembered: it raises again)
def _discovered(settings: CapacitySettings) -> tuple[NodeInventory, ...]:
    return tuple(_discover(settings))


def _discover(settings: CapacitySettings) -> list[NodeInventory]:
    if settings.discovery == "nvml":
        from tessera.capacity.nvml import discover_local_node

        try:
            return [discover_local_node(settings.nodes[0] if settings.nodes else settings.node)]
        except RuntimeError as exc:  # NVML unavailable
            raise ConfigError(str(exc)) from None
    nodes = profiles.load(settings.profile)
    if settings.nodes:
        wanted = set(settings.nodes)
        missing = wanted - {n.node for n in nodes}
        if missing:
            raise profiles.ProfileError(
                f"TESSERA_CAPACITY_NODES names nodes not in {settings.profile}: {', '.join(sorted(missing))}"
            )
        nodes = [n for n in nodes if n.node in wanted]
    return nodes
