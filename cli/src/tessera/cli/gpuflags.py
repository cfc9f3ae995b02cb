"""The command line's GPU flags as HAMi's resource and annotation names, for `submit` and `run`.

The names themselves are `tessera.shared.hami_names`, the words the translator reads. One flag is not
HAMi's: ``--scheduling-priority``, the claim's place in the queue and what it may preempt (the pod's
PriorityClass on Kubernetes); HAMi's ``--priority`` is the runtime priority of its processes on a
shared GPU, and orders nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection

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

# Each GPU flag once: (option, the HAMi name it sets, what it means). Resources are numbers, sent
# only when given (--gpus always: GPU); annotations are text. A command offers all or some of them.
MEMORY_FLAGS = (("--gpumem", GPUMEM, "MiB per GPU"),
                ("--gpumem-percent", GPUMEM_PERCENTAGE, "percent of each card's memory"))
RESOURCES = (*MEMORY_FLAGS,
             ("--gpucores", GPUCORES, "percent of SMs per GPU (100 = exclusive)"),
             ("--priority", PRIORITY, "HAMi's runtime priority, 0 (high) or 1 (low): how the claim's processes "
              "share a GPU's SMs; not its scheduling priority"))
ANNOTATIONS = (("--use-gputype", USE_GPUTYPE, "only these GPU models (comma-separated)"),
               ("--nouse-gputype", NOUSE_GPUTYPE, "not these GPU models (comma-separated)"),
               ("--use-gpuuuid", USE_GPUUUID, "only these GPUs (comma-separated UUIDs)"),
               ("--nouse-gpuuuid", NOUSE_GPUUUID, "not these GPUs (comma-separated UUIDs)"),
               ("--node-policy", NODE_POLICY, "binpack | spread"),
               ("--gpu-policy", GPU_POLICY, "binpack | spread | ..."))
RESOURCE_FLAGS = tuple((option[2:].replace("-", "_"), name) for option, name, _ in RESOURCES)
ANNOTATION_FLAGS = tuple((option[2:].replace("-", "_"), name) for option, name, _ in ANNOTATIONS)


def add_gpu_flags(parser: argparse.ArgumentParser, *, offered: Collection[str] | None = None,
                  exclusive_memory: bool = False) -> None:
    """--gpus and the GPU flags in ``offered`` (all by default); with ``exclusive_memory``,
    --gpumem and --gpumem-percent cannot both be given."""
    parser.add_argument("--gpus", type=int, default=1, help=f"{GPU}: number of GPUs (default 1)")
    parser.add_argument("--scheduling-priority", type=int, metavar="N",
                        help="the claim's scheduling priority (default 0; larger first, and with preemption on it "
                             "may take the place of preemptible claims of lower priority)")
    memory = parser.add_mutually_exclusive_group() if exclusive_memory else parser
    for option, name, meaning in (*RESOURCES, *ANNOTATIONS):
        if offered is not None and option not in offered:
            continue
        target = memory if any(option == m for m, _, _ in MEMORY_FLAGS) else parser
        kind = {"type": int} if any(option == r for r, _, _ in RESOURCES) else {}
        target.add_argument(option, help=f"{name}: {meaning}", **kind)


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
