"""Resource monitoring in the background: CPU utilisation, resident memory, GPU utilisation
and memory of this rank, sampled by a daemon thread every ``interval`` seconds.

The training step only reads the latest sample (a dict copy under a lock), so the sampling
(psutil's /proc reads, NVML queries) never sits on the step's hot path. The runner adds the
values to the per-rank fields it already gathers for ``metrics.jsonl`` (``rank_cpu_percent``,
``rank_rss_mb``, ``rank_gpu_util``, ``rank_gpu_mem_mb``), and ``hpctrain report`` plots them.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Dict, Optional

__all__ = ["FIELDS", "ResourceMonitor", "nvml_reader"]

#: what one sample holds; GPU fields are -1 where there is no GPU (or no NVML)
FIELDS = ("cpu_percent", "rss_mb", "gpu_util", "gpu_mem_mb")


def nvml_reader(device_index: int) -> Optional[Callable[[], Dict[str, float]]]:
    """A function returning this GPU's utilisation (%) and used memory (MiB), or None without
    NVML (nvidia-ml-py is installed but the driver may be absent)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    except Exception:  # noqa: BLE001 - no driver, no GPU: GPU fields stay -1
        return None

    def read() -> Dict[str, float]:
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {"gpu_util": float(util.gpu), "gpu_mem_mb": mem.used / 2**20}
    return read


class ResourceMonitor:
    """Samples this process in a daemon thread; :meth:`latest` returns the newest sample."""

    def __init__(self, interval: float = 1.0, gpu: Optional[Callable[[], Dict[str, float]]] = None,
                 pid: Optional[int] = None) -> None:
        import psutil

        self.interval = float(interval)
        self._proc = psutil.Process(pid or os.getpid())
        # psutil's own cpu_percent(None) answers 0.0 on its first call; measuring from the
        # process's start instead makes the first sample the average so far.
        self._last_cpu = (0.0, self._proc.create_time())
        self._gpu = gpu
        self._lock = threading.Lock()
        self._sample: Dict[str, float] = {f: -1.0 for f in FIELDS}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.samples = 0

    def sample_once(self) -> Dict[str, float]:
        s = {"cpu_percent": self._cpu_percent(), "rss_mb": self._proc.memory_info().rss / 2**20,
             "gpu_util": -1.0, "gpu_mem_mb": -1.0}
        if self._gpu is not None:
            try:
                s.update(self._gpu())
            except Exception:  # noqa: BLE001 - a GPU that stops answering must not stop training
                self._gpu = None
        with self._lock:
            self._sample = s
            self.samples += 1
        return s

    def _cpu_percent(self) -> float:
        """CPU time used since the previous sample over the wall time between them, in percent
        of one core (as psutil and top report it)."""
        times = self._proc.cpu_times()
        used, now = times.user + times.system, time.time()
        last_used, last_time = self._last_cpu
        self._last_cpu = (used, now)
        elapsed = now - last_time
        return 100.0 * max(used - last_used, 0.0) / elapsed if elapsed > 0 else 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample_once()
            except Exception:  # noqa: BLE001 - monitoring must never break training
                return

    def start(self) -> "ResourceMonitor":
        self.sample_once()
        self._thread = threading.Thread(target=self._run, name="hpctrain-monitor", daemon=True)
        self._thread.start()
        return self

    def latest(self) -> Dict[str, float]:
        with self._lock:
            return dict(self._sample)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)

    def __enter__(self) -> "ResourceMonitor":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
