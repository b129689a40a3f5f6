"""Process-wide allocator settings for processes that move ring frames. Imports nothing internal.

glibc's malloc serves blocks >= 128 KiB with a fresh ``mmap`` (its dynamic threshold rises only
after such a block is freed, per arena) and trims free heap above twice that threshold, so every
such buffer costs one page fault per 4 KiB on first touch. A ring of 10M floats moves ~256 KiB
frames through paho's growing packet buffers, the frame encoder, numpy and Mosquitto: `fractal
bench allreduce --nodes 4 --size 10000000 --repeats 8` took ~1.8-2.4M page faults. Keeping blocks
up to 4 MiB in the heap, and up to 64 MiB of free heap before any is handed back, removes most of
them (docs/benchmarks-history.md, "Frame buffers in the heap": ring calls 11-20% faster, member
CPU 12-21% lower). Larger blocks (whole parameter vectors) still come from mmap and go back at
free.

``FRACTAL_MALLOC=system`` in the environment keeps glibc's defaults (for comparison, or a board
that cannot spare the retained heap).
"""

from __future__ import annotations

import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_allocator", "child_env"]

MMAP_THRESHOLD = 4 << 20  # blocks below this come from the heap, not a fresh mmap
TRIM_THRESHOLD = 64 << 20  # free heap kept before any is handed back to the kernel
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt() parameters (glibc's malloc.h)
_tuned: bool | None = None


def _enabled() -> bool:
    return os.environ.get("FRACTAL_MALLOC", "") != "system"


def tune_allocator() -> bool:
    """Apply the settings to this process (once; at start, before frame buffers exist). Called by
    the ``fractal`` CLI (nodes, fleet, benchmarks), the training worker and benchmark members.
    Returns whether it took effect: False off glibc (musl, macOS) or with FRACTAL_MALLOC=system."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if not _enabled():
        return False
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = (bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
              and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    return _tuned


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: ours) for a non-Python child that moves frames too (Mosquitto): the same
    settings as glibc tunables, read by its malloc at start (ignored by other C libraries)."""
    out = dict(os.environ if env is None else env)
    if _enabled():
        ours = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"
        out["GLIBC_TUNABLES"] = ":".join(t for t in (out.get("GLIBC_TUNABLES", ""), ours) if t)
    return out
