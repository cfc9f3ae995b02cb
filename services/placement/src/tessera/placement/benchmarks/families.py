"""Workload families: variants of a pod list made the way the FGD paper makes its trace families.

The paper (Weng et al., ATC'23, Sec. 6) evaluates placement beyond the default openb pod list on
lists derived from it that emphasise one kind of task; the published lists were sampled from the
default one. This module makes such variants from whatever pod list the benchmark is given, each
at a level named on the command line, deterministically (a fixed generator seed, the paper's 233):

- ``cpu-only=N``: CPU-only pods added, sampled from the list's own CPU-only pods, until there are N;
- ``gpu-share=P``: GPU pods that ask for a whole GPU or more replaced by GPU-sharing pods sampled
  from the list's own, until P% of the GPU pods share a GPU;
- ``gpu-spec=P``: P% of the GPU pods (a random choice) constrained to one GPU model, drawn in
  proportion to the fleet's GPUs of each model;
- ``multi-gpu=N``: multi-GPU pods (2, 4, 8 GPUs) added, sampled from the list's own, until there
  are N.

The benchmark's method is unchanged on a variant: per seed, tasks are sampled from it to 130% of
the fleet's GPUs, and the policies measure against the variant's own task mix.
"""

from __future__ import annotations

import random
from dataclasses import replace

from .trace import TraceNode, TracePod

__all__ = ["FAMILIES", "DEFAULT_LEVELS", "parse_levels", "variant", "describe"]

GENERATOR_SEED = 233

FAMILIES = ("cpu-only", "gpu-share", "gpu-spec", "multi-gpu")
DEFAULT_LEVELS = {"cpu-only": (2000, 3000, 4000), "gpu-share": (60, 80, 100), "gpu-spec": (10, 25, 33),
                  "multi-gpu": (200, 400, 600)}
_UNIT = {"cpu-only": "CPU-only pods", "gpu-share": "% of GPU pods sharing", "gpu-spec": "% of GPU pods typed",
         "multi-gpu": "multi-GPU pods"}


def _is_share(p: TracePod) -> bool:
    return p.num_gpu == 1 and p.gpu_milli < 1000


def parse_levels(text: str, family: str) -> tuple[int, ...]:
    """'2000,3000' -> (2000, 3000); a clear error for anything else."""
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{family} takes whole numbers separated by commas, got {text!r}") from None
    if not levels:
        raise ValueError(f"--{family}: no levels in {text!r}")
    if family in ("gpu-share", "gpu-spec") and any(not 0 <= v <= 100 for v in levels):
        raise ValueError(f"--{family} levels are percentages (0-100), got {text!r}")
    if any(v < 0 for v in levels):
        raise ValueError(f"--{family} levels cannot be negative, got {text!r}")
    return levels


def describe(family: str, level: int) -> str:
    unit = _UNIT[family]
    return f"{level}{unit}" if unit.startswith("%") else f"{level:,} {unit}"


def variant(pods: list[TracePod], nodes: list[TraceNode], family: str, level: int) -> list[TracePod]:
    """The pod list of `family` at `level` (see the module text); the input is not changed."""
    rng = random.Random(f"{GENERATOR_SEED}:{family}:{level}")
    out = list(pods)
    if family == "cpu-only":
        pool = [p for p in pods if p.num_gpu == 0]
        have = len(pool)
        if not pool and level:
            raise ValueError("cpu-only: the pod list has no CPU-only pods to sample from")
        out += [_renamed(rng.choice(pool), f"cpu{i}") for i in range(max(0, level - have))]
    elif family == "multi-gpu":
        pool = [p for p in pods if p.num_gpu > 1]
        if not pool and level:
            raise ValueError("multi-gpu: the pod list has no multi-GPU pods to sample from")
        out += [_renamed(rng.choice(pool), f"multi{i}") for i in range(max(0, level - len(pool)))]
    elif family == "gpu-share":
        gpu = [i for i, p in enumerate(out) if p.num_gpu]
        share_pool = [p for p in pods if _is_share(p)]
        if not share_pool and level:
            raise ValueError("gpu-share: the pod list has no GPU-sharing pods to sample from")
        whole = [i for i in gpu if not _is_share(out[i])]
        rng.shuffle(whole)
        need = -(-level * len(gpu) // 100) - (len(gpu) - len(whole))
        for k, i in enumerate(whole[: max(0, need)]):
            out[i] = _renamed(rng.choice(share_pool), f"share{k}")
    elif family == "gpu-spec":
        by_model: dict[str, int] = {}
        for n in nodes:
            if n.gpus:
                by_model[n.model] = by_model.get(n.model, 0) + n.gpus
        models = sorted(by_model)
        weights = [by_model[m] for m in models]
        gpu = [i for i, p in enumerate(out) if p.num_gpu]
        for i in rng.sample(gpu, -(-level * len(gpu) // 100)):
            out[i] = replace(out[i], gpu_spec=(rng.choices(models, weights)[0],))
    else:
        raise ValueError(f"unknown workload family {family!r} (one of: {', '.join(FAMILIES)})")
    return out


def _renamed(p: TracePod, suffix: str) -> TracePod:
    return replace(p, name=f"{p.name}-{suffix}")
