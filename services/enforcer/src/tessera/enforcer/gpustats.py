"""What the real GPUs say about themselves (NVML): whole-device memory and utilization, and per-process
SM utilization for the containers' utilization metric.

Only on a node with the real driver: the simulated NVML has no utilization to report, and a number
made up for it would be worse than an absent series (HAMi's own monitor reports 0 when it cannot
tell, and its users learned the hard way that zero does not mean idle). Any NVML failure turns into
"no data", never into an exception in the observe loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("tessera.enforcer.gpustats")


@dataclass(frozen=True)
class DeviceStats:
    memory_used_bytes: int
    utilization: int  # percent, 0-100, the driver's sample window
    process_sm: dict[int, int] = field(default_factory=dict)  # pid -> SM utilization percent


class GpuStats:
    def __init__(self, enabled: bool) -> None:
        self.nvml = None
        self.last_sample_us = 0
        if not enabled:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            log.info("NVML available: host GPU utilization is reported")
        except Exception as exc:  # no driver, no library: the metrics that need it are simply absent
            log.info("NVML not available (%s): host GPU utilization is not reported", exc)

    def sample(self) -> dict[str, DeviceStats]:
        nv = self.nvml
        if nv is None:
            return {}
        out: dict[str, DeviceStats] = {}
        since = self.last_sample_us
        self.last_sample_us = int(time.time() * 1e6)
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = nv.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                memory = nv.nvmlDeviceGetMemoryInfo(handle)
                util = nv.nvmlDeviceGetUtilizationRates(handle)
                per_pid: dict[int, int] = {}
                try:
                    for sample in nv.nvmlDeviceGetProcessUtilization(handle, since):
                        per_pid[int(sample.pid)] = max(per_pid.get(int(sample.pid), 0), int(sample.smUtil))
                except Exception:  # NOT_FOUND when no process ran since `since`; unsupported on some GPUs
                    pass
                out[uuid] = DeviceStats(int(memory.used), int(util.gpu), per_pid)
        except Exception as exc:
            log.warning("NVML sample failed: %s", exc)
            return {}
        return out

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self.nvml = None
