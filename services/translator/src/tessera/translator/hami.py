"""HAMi's GPU request vocabulary, translated into a validated ``ClaimSpec``.

Workloads written for HAMi ask for GPU slices with extended resources (``nvidia.com/gpu``,
``nvidia.com/gpumem``, ...) and pod annotations. Tessera accepts the same words so that those
manifests keep working, and reads them the way HAMi does (HAMi v2.10: ``pkg/device/nvidia/device.go``
``GenerateResourceRequests`` / ``MutateAdmission`` / ``Fit``, ``pkg/device/devices.go`` ``CheckUUID``,
``pkg/util`` scheduler-policy lookup, the chart's device config ``defaultMemory: 0``,
``defaultCores: 0``, ``defaultGPUNum: 1``). Where HAMi silently drops, clamps or misreads a value
(the pod then runs on the wrong share, or stays Pending with no explanation), Tessera refuses it
with a message that names the field, the allowed range and the fix.

Rules, HAMi next to Tessera (values are read from limits, else requests, as HAMi does):

| input | HAMi | Tessera |
|---|---|---|
| value format | a Kubernetes quantity read with ``AsInt64`` | same: plain integers and decimal suffixes (``10k`` is how the API server re-serialises ``10000``) |
| fractional value (``0.5``, ``500m``) | ``AsInt64`` fails, value ignored (gpu: no GPU at all; gpumem: whole card) | rejected: whole numbers only |
| binary suffix on ``gpumem`` (``8Gi``) | read as 8589934592 *MiB*, truncated to int32 | rejected, with the MiB figure to write instead (``8192``) |
| not a quantity (``lots``) | API server rejects it | rejected (also for NATS / CLI input) |
| negative value | passes through into the accounting | rejected |
| ``gpu`` count | any; 0 means no GPU | 1..16 (``ClaimSpec.gpus``) |
| ``gpu`` 0 together with gpumem / gpumem-percentage / gpucores | container silently gets no GPU | rejected |
| ``gpu`` absent, gpumem / gpumem-percentage / gpucores present | webhook adds ``gpu: defaultGPUNum`` (1) | same (``HamiDefaults.gpu_num``); if that is 0: rejected (HAMi drops the request) |
| ``gpumem`` (MiB per GPU) | any int32 | 1..1048576 MiB (no GPU has 1 TiB); 0 rejected (HAMi reads 0 as "whole card") |
| ``gpumem-percentage`` | any; >100 never fits (Pending forever), 0 gives a 0-MiB share | 1..100 |
| both ``gpumem`` and ``gpumem-percentage`` | gpumem wins, percentage silently ignored | rejected: set one |
| neither memory resource | ``defaultMemory`` MiB if non-zero, else 100 % of the card | same: ``memory_mib = HamiDefaults.memory_mib`` or ``memory_percent = 100`` |
| ``gpucores`` (percent of SMs, per GPU) | >100 clamped to 100 with a log line | 0..100; 101+ rejected |
| ``gpucores`` absent | 100 (exclusive) when the memory is the whole card (no gpumem, or percentage 100), else ``defaultCores`` (0) | same |
| ``priority`` | copied to ``CUDA_TASK_PRIORITY``; HAMi-core reads any int, unset = 1 | 0 (high) or 1 (low) only; kept as ``ClaimSpec.task_priority`` (see below) |
| ``priority`` with no GPU request | env var set, nothing else | rejected |
| unknown ``nvidia.com/gpu…`` name (``gpumemory``, ``gpucore``) | ignored; the pod asks for a resource no node has | rejected with the nearest known name |
| ``use-gputype`` / ``nouse-gputype`` | comma list, case-insensitive substring of the card type | same; entries trimmed, empty entries rejected (HAMi: ``"A100,"`` matches every card) |
| a ``nouse-gputype`` entry inside a ``use-gputype`` entry (``use A100``, ``nouse a100``) | the pod can never fit | rejected |
| ``use-gpuuuid`` / ``nouse-gpuuuid`` | comma list, exact match, both applied (v2.9+, #1965) | same; empty entries and a UUID in both lists rejected |
| fewer ``use-gpuuuid`` UUIDs than ``gpu`` | never fits | rejected |
| ``hami.io/node-scheduler-policy``, ``hami.io/gpu-scheduler-policy`` | ``binpack`` / ``spread`` (gpu also ``topology-aware``); anything else ignored with a log line, the default applies | ``binpack``, ``spread``, ``fragmentation-aware``, ``best-fit``; anything else rejected (``topology-aware`` too) |

Priority: HAMi's ``nvidia.com/priority`` is a runtime priority, 0 = high, 1 = low (HAMi-core's
default when unset): how a process shares a GPU's SMs while it runs. It becomes
``ClaimSpec.task_priority`` and nothing else: it neither orders the queue nor preempts. The
scheduling priority, ``ClaimSpec.priority`` (larger = more important, as in Kubernetes), comes
from elsewhere: the pod's PriorityClass on Kubernetes (the webhook reads ``spec.priority``),
``--scheduling-priority`` on the CLI, ``SubmitRequest.scheduling_priority`` in the API.

Type selectors keep HAMi's semantics: each entry of ``ClaimSpec.use_types`` / ``nouse_types`` is a
case-insensitive substring of the GPU model; UUIDs match exactly.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import get_args

import msgspec

from tessera.shared.events import ClaimSpec, Policy
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
    RESOURCE_NAMES,
    USE_GPUTYPE,
    USE_GPUUUID,
)

MAX_GPUS = 16  # ClaimSpec.gpus
MAX_MEMORY_MIB = 1 << 20  # 1 TiB per GPU: far above any card, far below HAMi's int32 wrap-around
POLICIES: tuple[str, ...] = get_args(Policy)

_MIB = 1 << 20
_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
# Kubernetes' quantity grammar (k8s.io/apimachinery resource.ParseQuantity).
_QUANTITY = re.compile(
    r"(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<bin>[KMGTPE]i)|[eE](?P<exp>[+-]?[0-9]+)|(?P<dec>[numkMGTPE]?))"
)


@dataclass(frozen=True)
class HamiDefaults:
    """HAMi's scheduler device config (``nvidia:`` section), with the chart's defaults."""

    gpu_num: int = 1  # defaultGPUNum: added when only gpumem/percentage/cores are set; 0 = don't
    memory_mib: int = 0  # defaultMemory: MiB when no memory resource is set; 0 = the whole card
    cores: int = 0  # defaultCores: percent when gpucores is unset and the card is not whole


class TranslationError(ValueError):
    """A GPU request that Tessera refuses; ``field`` and ``value`` point at the culprit."""

    def __init__(self, field: str, value: object, problem: str, *, where: str = "") -> None:
        self.field = field
        self.value = value
        self.problem = problem
        self.where = where
        shown = "" if value is None else f"={value!r}"
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{field}{shown}: {problem}")


def _res(name: str) -> str:
    return f'resources["{name}"]'


def _ann(name: str) -> str:
    return f'annotations["{name}"]'


def _parse_quantity(text: str) -> tuple[Decimal, str]:
    """Return (value, binary suffix or "") for a Kubernetes quantity string, or raise ValueError."""
    m = _QUANTITY.fullmatch(text) if len(text) <= 64 else None
    if m is None:
        raise ValueError("not a number")
    num = Decimal(m["num"])
    if m["bin"]:
        return num * _BINARY[m["bin"]], m["bin"]
    exp = int(m["exp"]) if m["exp"] is not None else _DECIMAL[m["dec"]]
    if abs(exp) > 30:  # far outside every range here; keeps int() of the result cheap
        raise ValueError("number out of range")
    return num.scaleb(exp), ""


def _whole_number(
    resources: Mapping[str, object],
    name: str,
    lo: int,
    hi: int,
    meaning: str,
    where: str,
    hami: Mapping[str, str] = {},  # noqa: B006 - read-only
) -> int:
    raw = resources[name]
    field = _res(name)
    span = f"{meaning}, a whole number from {lo} to {hi}"
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        problem = f"must be {span}, given as a string or an integer"
        raise TranslationError(field, raw, problem, where=where)
    if isinstance(raw, int):
        value, binary = Decimal(raw), ""
    else:
        try:
            value, binary = _parse_quantity(raw)
        except ValueError:
            raise TranslationError(
                field, raw, f"is not a Kubernetes quantity; it must be {span}", where=where
            ) from None
    if binary:
        if name == GPUMEM:
            mib = value / _MIB
            fix = f"Write {mib.normalize():f}" if mib == mib.to_integral_value() else "Convert it to MiB"
            problem = (
                f"gpumem counts MiB, not bytes: HAMi would read {raw!r} as {value:f} MiB. "
                f"{fix} ({span})"
            )
        else:
            problem = f"binary suffixes ({binary}) make no sense here; it must be {span}"
        raise TranslationError(field, raw, problem, where=where)
    if value != value.to_integral_value():
        raise TranslationError(
            field, raw, f"must be {span}; HAMi would silently ignore a fractional value", where=where
        )
    number = int(value)
    if not lo <= number <= hi:
        side = "low" if number < lo else "high"
        note = f"; {hami[side]}" if side in hami else ""
        raise TranslationError(field, raw, f"is out of range: it must be {span}{note}", where=where)
    return number


def _listed(annotations: Mapping[str, str], name: str, where: str) -> list[str]:
    """A comma-separated annotation as a list: entries trimmed, duplicates dropped, none empty."""
    if name not in annotations:
        return []
    raw = annotations[name]
    field = _ann(name)
    if not isinstance(raw, str):
        raise TranslationError(field, raw, "must be a string (a comma-separated list)", where=where)
    entries: list[str] = []
    seen: set[str] = set()
    for part in raw.split(","):
        entry = part.strip()
        if not entry:
            raise TranslationError(
                field,
                raw,
                "has an empty entry; HAMi would treat it as matching every GPU. "
                "Write a comma-separated list without empty items, e.g. 'A100,H100'",
                where=where,
            )
        if entry.upper() not in seen:
            seen.add(entry.upper())
            entries.append(entry)
    return entries


def _policy(annotations: Mapping[str, str], name: str, where: str) -> str | None:
    if name not in annotations:
        return None
    raw = annotations[name]
    field = _ann(name)
    allowed = ", ".join(POLICIES)
    if not isinstance(raw, str):
        raise TranslationError(field, raw, f"must be one of: {allowed}", where=where)
    value = raw.strip()
    if value in POLICIES:
        return value
    if value.lower() in POLICIES:
        problem = f"policies are lower case: write {value.lower()!r} (one of: {allowed})"
    elif value == "topology-aware":
        problem = f"HAMi's topology-aware GPU policy is not supported by Tessera; use one of: {allowed}"
    else:
        problem = (
            "is not a scheduling policy; HAMi would ignore it and use its default. "
            f"Use one of: {allowed}"
        )
    raise TranslationError(field, raw, problem, where=where)


def _unknown_names(resources: Mapping[str, object], where: str) -> None:
    # Guard typos of HAMi's names; leave other nvidia.com resources (MIG profiles, gpu.shared) alone.
    for name in resources:
        if name in RESOURCE_NAMES or not re.match(r"^nvidia\.com/gpu[A-Za-z0-9_-]", name):
            continue
        close = difflib.get_close_matches(name, RESOURCE_NAMES, n=1, cutoff=0.6)
        hint = f"Did you mean {close[0]!r}? " if close else ""
        known = ", ".join(RESOURCE_NAMES)
        raise TranslationError(
            _res(name),
            resources[name],
            f"is not a HAMi resource name; HAMi would ignore it and the pod would wait for a "
            f"resource no node offers. {hint}Known names: {known}",
            where=where,
        )


def _is_zero(raw: object) -> bool:
    if isinstance(raw, bool):
        return False
    if isinstance(raw, int):
        return raw == 0
    if isinstance(raw, str):
        try:
            return _parse_quantity(raw)[0] == 0
        except ValueError:
            return False
    return False


def is_gpu_request(resources: Mapping[str, object]) -> bool:
    """Whether a container's resources concern HAMi's GPUs (and so need ``translate``).

    A lone ``nvidia.com/gpu: 0`` is not a request (HAMi agrees); anything else with a HAMi name, or
    a misspelt one, is, so that ``translate`` can accept or reject it.
    """
    for name in resources:
        if name in (GPUMEM, GPUMEM_PERCENTAGE, GPUCORES, PRIORITY):
            return True
        if re.match(r"^nvidia\.com/gpu[A-Za-z0-9_-]", name):
            return True
    return GPU in resources and not _is_zero(resources[GPU])


def translate(
    resources: Mapping[str, object],
    annotations: Mapping[str, str] = {},  # noqa: B006 - read-only
    *,
    where: str = "",
    defaults: HamiDefaults = HamiDefaults(),  # noqa: B008 - frozen
) -> ClaimSpec:
    """Translate one container's HAMi resources (plus its pod's annotations) into a ClaimSpec.

    ``resources`` maps resource names to Kubernetes quantities (limits, else requests); names
    outside ``nvidia.com/`` (cpu, memory) are ignored. ``where`` prefixes every error message
    (for example ``container "train"``). Raises ``TranslationError`` for anything HAMi would
    drop, clamp or misread; see the module docstring for the rules.
    """
    _unknown_names(resources, where)
    present = {name for name in RESOURCE_NAMES if name in resources}
    if not present - {PRIORITY, GPU} and GPU not in present:
        if PRIORITY in present:
            raise TranslationError(
                _res(PRIORITY),
                resources[PRIORITY],
                f"sets a GPU task priority but asks for no GPU; add {GPU} (1..{MAX_GPUS}) or remove it",
                where=where,
            )
        raise TranslationError(
            "resources", None, f"ask for no GPU: set {GPU} to a count from 1 to {MAX_GPUS}", where=where
        )

    shares = present & {GPUMEM, GPUMEM_PERCENTAGE, GPUCORES}
    if GPU in present:
        if _is_zero(resources[GPU]):
            if shares:
                names = ", ".join(sorted(shares))
                raise TranslationError(
                    _res(GPU),
                    resources[GPU],
                    f"asks for 0 GPUs while {names} asks for a share of one; HAMi would silently "
                    f"give the container no GPU. Set {GPU} from 1 to {MAX_GPUS}, or remove {names}",
                    where=where,
                )
            raise TranslationError(
                _res(GPU), resources[GPU], f"asks for 0 GPUs: set 1 to {MAX_GPUS}", where=where
            )
        gpus = _whole_number(resources, GPU, 1, MAX_GPUS, "a GPU count", where)
    elif defaults.gpu_num > 0:
        gpus = defaults.gpu_num
    else:
        raise TranslationError(
            _res(GPU),
            None,
            f"is required when defaultGPUNum is 0; HAMi would silently drop this request. "
            f"Set {GPU} from 1 to {MAX_GPUS}",
            where=where,
        )

    memory_mib: int | None = None
    memory_percent: int | None = None
    if GPUMEM in present and GPUMEM_PERCENTAGE in present:
        raise TranslationError(
            _res(GPUMEM_PERCENTAGE),
            resources[GPUMEM_PERCENTAGE],
            f"is set together with {GPUMEM}={resources[GPUMEM]!r}; HAMi would silently ignore the "
            f"percentage. Set only one: {GPUMEM} (MiB per GPU) or {GPUMEM_PERCENTAGE} "
            f"(percent of the card)",
            where=where,
        )
    if GPUMEM in present:
        memory_mib = _whole_number(
            resources,
            GPUMEM,
            1,
            MAX_MEMORY_MIB,
            "GPU memory per GPU in MiB",
            where,
            {
                "low": f"HAMi reads 0 as the whole card: to ask for that, omit {GPUMEM} "
                f"or set {GPUMEM_PERCENTAGE} to 100"
            },
        )
    elif GPUMEM_PERCENTAGE in present:
        memory_percent = _whole_number(
            resources,
            GPUMEM_PERCENTAGE,
            1,
            100,
            "a percent of each GPU's memory",
            where,
            {"high": "HAMi would accept it and the pod would stay Pending forever"},
        )
    elif defaults.memory_mib > 0:
        memory_mib = defaults.memory_mib
    else:
        memory_percent = 100

    if GPUCORES in present:
        cores = _whole_number(
            resources,
            GPUCORES,
            0,
            100,
            "a percent of each GPU's SMs (100 = the whole GPU, exclusive)",
            where,
            {"high": "HAMi would silently clamp it to 100"},
        )
    elif GPUMEM_PERCENTAGE in present:
        cores = 100 if memory_percent == 100 else defaults.cores
    elif GPUMEM not in present:
        cores = 100  # whole card asked for: HAMi makes it exclusive
    else:
        cores = defaults.cores

    task_priority = None
    if PRIORITY in present:
        task_priority = _whole_number(resources, PRIORITY, 0, 1, "0 (high) or 1 (low)", where)

    use_types = _listed(annotations, USE_GPUTYPE, where)
    nouse_types = _listed(annotations, NOUSE_GPUTYPE, where)
    for wanted in use_types:
        for unwanted in nouse_types:
            if unwanted.upper() in wanted.upper():
                raise TranslationError(
                    _ann(NOUSE_GPUTYPE),
                    annotations[NOUSE_GPUTYPE],
                    f"excludes {unwanted!r}, which every GPU selected by {USE_GPUTYPE} entry "
                    f"{wanted!r} contains (matching is a case-insensitive substring), so that entry "
                    f"can never match. Remove one of the two",
                    where=where,
                )
    use_uuids = _listed(annotations, USE_GPUUUID, where)
    nouse_uuids = _listed(annotations, NOUSE_GPUUUID, where)
    for field_name, uuids in ((USE_GPUUUID, use_uuids), (NOUSE_GPUUUID, nouse_uuids)):
        for uuid in uuids:
            if re.search(r"\s", uuid):
                raise TranslationError(
                    _ann(field_name),
                    annotations[field_name],
                    f"entry {uuid!r} contains whitespace; GPU UUIDs (e.g. GPU-8f2c...) have none. "
                    f"Separate UUIDs with commas",
                    where=where,
                )
    both = {u.upper() for u in use_uuids} & {u.upper() for u in nouse_uuids}
    if both:
        raise TranslationError(
            _ann(NOUSE_GPUUUID),
            annotations[NOUSE_GPUUUID],
            f"excludes {', '.join(sorted(both))}, which {USE_GPUUUID} asks for; a UUID cannot be both "
            f"wanted and excluded. Remove it from one of the two",
            where=where,
        )
    if use_uuids and len(use_uuids) < gpus:
        raise TranslationError(
            _ann(USE_GPUUUID),
            annotations[USE_GPUUUID],
            f"allows {len(use_uuids)} GPU(s) but the container asks for {gpus} distinct GPUs, so it "
            f"could never be placed. List at least {gpus} UUIDs or lower {GPU}",
            where=where,
        )

    fields = {
        "gpus": gpus,
        "memory_mib": memory_mib,
        "memory_percent": memory_percent,
        "cores": cores,
        "use_types": use_types,
        "nouse_types": nouse_types,
        "use_uuids": use_uuids,
        "nouse_uuids": nouse_uuids,
        "node_policy": _policy(annotations, NODE_POLICY, where),
        "gpu_policy": _policy(annotations, GPU_POLICY, where),
        "task_priority": task_priority,
    }
    try:  # the Struct's own constraints, as a last line of defence
        return msgspec.convert(fields, ClaimSpec)
    except msgspec.ValidationError as exc:  # pragma: no cover - the checks above come first
        raise TranslationError("resources", None, str(exc), where=where) from None
