"""HAMi's resource names from the command line's GPU flags, in one place for `submit` and `run`."""

from __future__ import annotations


def resources_from(args) -> dict[str, int]:
    """--gpus/--gpumem/--gpumem-percent/--gpucores/--priority as HAMi resource requests."""
    resources: dict[str, int] = {"nvidia.com/gpu": args.gpus}
    for flag, name in (("gpumem", "nvidia.com/gpumem"), ("gpumem_percent", "nvidia.com/gpumem-percentage"),
                       ("gpucores", "nvidia.com/gpucores"), ("priority", "nvidia.com/priority")):
        value = getattr(args, flag, None)
        if value is not None:
            resources[name] = value
    return resources
