"""HAMi's words for a GPU request: its extended-resource and pod-annotation names.

Defined once here because two sides speak them: the translator reads them off pods and API
requests (`tessera.translator.hami`), and the CLI writes them from its flags (`tessera submit`,
`tessera run`). A name spelt differently on one side would be a request the other never sees.
"""

from __future__ import annotations

# Extended resources (per container; limits, else requests).
GPU = "nvidia.com/gpu"  # number of GPUs
GPUMEM = "nvidia.com/gpumem"  # MiB per GPU
GPUMEM_PERCENTAGE = "nvidia.com/gpumem-percentage"  # percent of each card's memory
GPUCORES = "nvidia.com/gpucores"  # percent of SMs per GPU
PRIORITY = "nvidia.com/priority"  # 0 high, 1 low
RESOURCE_NAMES: tuple[str, ...] = (GPU, GPUMEM, GPUMEM_PERCENTAGE, GPUCORES, PRIORITY)

# Pod annotations.
USE_GPUTYPE = "nvidia.com/use-gputype"  # comma list, substrings of the card type
NOUSE_GPUTYPE = "nvidia.com/nouse-gputype"
USE_GPUUUID = "nvidia.com/use-gpuuuid"  # comma list, exact UUIDs
NOUSE_GPUUUID = "nvidia.com/nouse-gpuuuid"
NODE_POLICY = "hami.io/node-scheduler-policy"
GPU_POLICY = "hami.io/gpu-scheduler-policy"
