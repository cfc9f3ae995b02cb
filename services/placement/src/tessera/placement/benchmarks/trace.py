"""Reading the Alibaba openb GPU traces (FGD paper, USENIX ATC'23) into placement's own types.

The packing benchmark replays these traces through the same engine the service runs, so the loader
turns trace rows into `NodeInventory` and claim `Demand`s. It accepts every published variant: node
lists `sn,cpu_milli,memory_mib,gpu,model`; pod lists with the full columns or only the first five
(`name,cpu_milli,memory_mib,num_gpu,gpu_milli`), with or without a header, with `gpu_spec`
constraints ('|'-separated models) and CPU-only tasks (num_gpu 0). A bad row is an error naming
file:line and what is wrong; nothing is silently dropped or clamped.

How trace quantities map to claims: `gpu_milli` is a task's share of one GPU's compute *and* memory
(the trace's own definition). A task with gpu_milli < 1000 becomes a claim of ceil(gpu_milli/10)%
of the card's memory and of its cores (all openb values are multiples of 10, so this is exact); a
task with gpu_milli 1000 takes `num_gpu` whole GPUs exclusively (cores 100, whole memory). GPU units
for the paper's x and y are counted from the trace itself, num_gpu * gpu_milli / 1000, never from
rounded claims.

Card memory per openb model. Because openb shares are fractions of a card, these sizes do not change
packing results; they only make the devices realistic for the engine:

    model     memory   note
    V100M16   16 GiB   Tesla V100 16 GB
    V100M32   32 GiB   Tesla V100 32 GB
    P100      16 GiB   Tesla P100 16 GB
    T4        16 GiB   Tesla T4 (nominal 16 GB)
    A10       24 GiB   A10
    G1        16 GiB   undisclosed in the trace: our choice
    G2        32 GiB   undisclosed in the trace: our choice
    G3        80 GiB   undisclosed in the trace: our choice
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from tessera.shared.events import GpuDevice, NodeInventory

from ..mix import Demand

__all__ = ["GPU_MEMORY_MIB", "TraceError", "TraceNode", "TracePod", "load_nodes", "load_pods",
           "node_inventory", "pod_demand"]

GPU_MEMORY_MIB: dict[str, int] = {
    "V100M16": 16 * 1024,
    "V100M32": 32 * 1024,
    "P100": 16 * 1024,
    "T4": 16 * 1024,
    "A10": 24 * 1024,
    "G1": 16 * 1024,
    "G2": 32 * 1024,
    "G3": 80 * 1024,
}


class TraceError(ValueError):
    """A trace file that cannot be read; the message names file:line and the problem."""


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...] = ()
    # Seconds from the trace's start, where the list has them (the dynamic replay uses them).
    creation_time: int | None = None
    deletion_time: int | None = None

    @property
    def gpu_units(self) -> float:
        """GPUs this task requests, in the paper's units."""
        return self.num_gpu * self.gpu_milli / 1000


_NODE_COLS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
_POD_COLS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")


def _rows(path: Path, required: tuple[str, ...], aliases: dict[str, str]):
    """Yield (line number, {column: value}) for each data row; header optional."""
    try:
        f = path.open(newline="", encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    with f:
        reader = csv.reader(f)
        header: list[str] | None = None
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            cells = [c.strip() for c in row]
            if header is None:
                if not cells[1:2] or not re.fullmatch(r"-?\d+(\.\d+)?", cells[1]):
                    header = [aliases.get(c.lower(), c.lower()) for c in cells]
                    missing = [c for c in required if c not in header]
                    if missing:
                        raise TraceError(f"{path}:{line}: header lacks column(s) {', '.join(missing)} "
                                         f"(expected {','.join(required)}, got {','.join(cells)})")
                    continue
                header = list(required)  # no header: positional columns
            if len(cells) < len(required):
                raise TraceError(f"{path}:{line}: {len(cells)} column(s), expected at least "
                                 f"{len(required)} ({','.join(header[:len(required)])})")
            yield line, dict(zip(header, cells, strict=False))


def _int(path: Path, line: int, col: str, value: str, lo: int = 0, hi: int | None = None) -> int:
    try:
        v = int(value)
    except ValueError:
        try:
            f = float(value)
        except ValueError:
            raise TraceError(f"{path}:{line}: {col} is {value!r}, not a number") from None
        if not f.is_integer():
            raise TraceError(f"{path}:{line}: {col} is {value!r}, not a whole number") from None
        v = int(f)
    if v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise TraceError(f"{path}:{line}: {col} is {v}, must be {bound}")
    return v


def _node_name(raw: str) -> str:
    name = re.sub(r"[^a-z0-9.-]+", "-", raw.lower()).strip("-.")
    return name[:63] or "node"


def load_nodes(path: str | Path) -> list[TraceNode]:
    path = Path(path)
    nodes = []
    seen: dict[str, int] = {}
    for line, r in _rows(path, _NODE_COLS, {"name": "sn", "num_gpu": "gpu"}):
        name = r["sn"]
        if not name:
            raise TraceError(f"{path}:{line}: empty node name (sn)")
        gpus = _int(path, line, "gpu", r["gpu"], 0, 64)
        model = r["model"]
        if gpus and model not in GPU_MEMORY_MIB:
            raise TraceError(f"{path}:{line}: unknown GPU model {model!r} "
                             f"(known: {', '.join(GPU_MEMORY_MIB)})")
        node = TraceNode(_node_name(name), _int(path, line, "cpu_milli", r["cpu_milli"], 1),
                         _int(path, line, "memory_mib", r["memory_mib"], 1), gpus, model if gpus else "")
        if node.name in seen:
            raise TraceError(f"{path}:{line}: node {name!r} already listed on line {seen[node.name]}")
        seen[node.name] = line
        nodes.append(node)
    if not nodes:
        raise TraceError(f"{path}: no nodes")
    return nodes


def load_pods(path: str | Path) -> list[TracePod]:
    path = Path(path)
    pods = []
    for line, r in _rows(path, _POD_COLS, {"sn": "name"}):
        num_gpu = _int(path, line, "num_gpu", r["num_gpu"], 0, 16)
        gpu_milli = _int(path, line, "gpu_milli", r["gpu_milli"], 0, 1000)
        if num_gpu == 0 and gpu_milli:
            raise TraceError(f"{path}:{line}: gpu_milli is {gpu_milli} but num_gpu is 0")
        if num_gpu and not gpu_milli:
            raise TraceError(f"{path}:{line}: num_gpu is {num_gpu} but gpu_milli is 0")
        if num_gpu > 1 and gpu_milli != 1000:
            raise TraceError(f"{path}:{line}: gpu_milli is {gpu_milli} with num_gpu {num_gpu}; "
                             f"a share below one GPU is only valid for num_gpu 1")
        spec_raw = r.get("gpu_spec", "") or ""
        spec = tuple(m.strip() for m in spec_raw.split("|") if m.strip())
        if num_gpu == 0 and spec:
            spec = ()  # a GPU model constraint on a CPU-only task constrains nothing
        times = []
        for col in ("creation_time", "deletion_time"):
            raw = (r.get(col) or "").strip()
            times.append(_int(path, line, col, raw) if raw else None)
        pods.append(TracePod(r["name"], _int(path, line, "cpu_milli", r["cpu_milli"]),
                             _int(path, line, "memory_mib", r["memory_mib"]), num_gpu, gpu_milli, spec,
                             times[0], times[1]))
    if not pods:
        raise TraceError(f"{path}: no pods")
    return pods


def node_inventory(node: TraceNode, max_shares: int = 10) -> NodeInventory:
    mem = GPU_MEMORY_MIB.get(node.model, 16 * 1024)
    return NodeInventory(
        node=node.name,
        devices=[GpuDevice(uuid=f"GPU-{node.name}-{i}", index=i, model=node.model, memory_mib=mem,
                           max_shares=max_shares) for i in range(node.gpus)],
        cpu_millis=node.cpu_milli, host_memory_mib=node.memory_mib, ts=0.0,
    )


def pod_demand(pod: TracePod) -> Demand:
    """The claim a trace task makes (gpus may be 0: the simulator places CPU-only tasks too)."""
    if pod.num_gpu == 0:
        return Demand(gpus=0, cpu=pod.cpu_milli, hostmem=pod.memory_mib)
    if pod.gpu_milli >= 1000:
        return Demand(gpus=pod.num_gpu, cores=100, use_types=pod.gpu_spec, cpu=pod.cpu_milli,
                      hostmem=pod.memory_mib)
    pct = min(99, -(-pod.gpu_milli // 10))
    return Demand(gpus=1, memory_percent=pct, cores=pct, use_types=pod.gpu_spec, cpu=pod.cpu_milli,
                  hostmem=pod.memory_mib)
