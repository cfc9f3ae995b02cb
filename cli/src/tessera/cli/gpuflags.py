"""The command line's GPU flags as HAMi's resource and annotation names, for `submit` and `run`.

The names themselves are `tessera.shared.hami_names`, the words the translator reads.
"""

from __future__ import annotations

from tessera.shared.hami_names import (
    GPU,
    GPU_POLICY,
    GPUCORES,
    GPUMEM,
    GPUMEM_PERCENTAGE,
    NODE_POLICY,
    NOUSE_GPUTYPE,
    NOUSE_GPUUUID,
    PRIORITY,
    USE_GPUTYPE,
    USE_GPUUUID,
)

# argparse destination -> the resource it asks for (--gpus is always sent: GPU)
RESOURCE_FLAGS = (("gpumem", GPUMEM), ("gpumem_percent", GPUMEM_PERCENTAGE), ("gpucores", GPUCORES),
                  ("priority", PRIORITY))
# argparse destination -> the annotation it sets (a command defines the ones it offers)
ANNOTATION_FLAGS = (("use_gputype", USE_GPUTYPE), ("nouse_gputype", NOUSE_GPUTYPE), ("use_gpuuuid", USE_GPUUUID),
                    ("nouse_gpuuuid", NOUSE_GPUUUID), ("node_policy", NODE_POLICY), ("gpu_policy", GPU_POLICY))


def resources_from(args) -> dict[str, int]:
    """--gpus/--gpumem/--gpumem-percent/--gpucores/--priority as HAMi resource requests."""
    resources: dict[str, int] = {GPU: args.gpus}
    for flag, name in RESOURCE_FLAGS:
        value = getattr(args, flag, None)
        if value is not None:
            resources[name] = value
    return resources


def annotations_from(args) -> dict[str, str]:
    """--use-gputype, --gpu-policy, ... (those the command has, and set) as HAMi annotations."""
    return {name: value for flag, name in ANNOTATION_FLAGS if (value := getattr(args, flag, None))}
