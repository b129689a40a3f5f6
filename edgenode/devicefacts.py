"""What a node tells the fleet about its device: uptime, CPU and memory use, free disk.

Standard library only (``os.times``, ``/proc/self/statm``, ``os.sysconf``, ``shutil.disk_usage``)
rather than psutil: the node also runs inside the minimal aarch64 sysroot under qemu-user and
on boards where a compiled psutil wheel is one more thing to cross-build. Linux is the target.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

from federation.messages import NodeHealth

__all__ = ["DeviceFacts"]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # peak, in KiB on Linux


def _total_memory() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return 0


class DeviceFacts:
    """``health()`` samples the process: CPU percent is over the time since the previous call
    (the first call: since the object was made), as ``top`` shows it (100 = one core busy)."""

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._last = (self._t0, self._cpu())
        self._total = _total_memory()

    @staticmethod
    def _cpu() -> float:
        t = os.times()
        return t.user + t.system

    def health(self) -> NodeHealth:
        now, cpu = time.monotonic(), self._cpu()
        with self._lock:
            (t_prev, c_prev), self._last = self._last, (now, cpu)
        pct = 100.0 * (cpu - c_prev) / (now - t_prev) if now > t_prev else 0.0
        rss = _rss_bytes()
        try:
            free = shutil.disk_usage(self.data_dir).free
        except OSError:
            free = 0
        return NodeHealth(uptime_s=round(now - self._t0, 1), cpu_percent=round(max(0.0, pct), 1),
                          mem_rss_bytes=rss,
                          mem_percent=round(min(100.0, 100.0 * rss / self._total), 2) if self._total else 0.0,
                          disk_free_bytes=free)
