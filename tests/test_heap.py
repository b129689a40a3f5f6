"""fractal/heap.py: frame-sized buffers stay in the heap (fewer page faults)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Builds 256 KiB packets the way paho reads a message (bytes += piece) on a thread, keeping a few
# alive as a send window does, and prints the page faults it took.
_CHURN = """
import resource, sys, threading
from fractal.heap import tune_allocator
print(tune_allocator())
def churn():
    keep = []
    for _ in range(300):
        pkt = b""
        for _ in range(128):
            pkt += b"x" * 2048
        keep.append(pkt)
        if len(keep) > 4:
            keep.pop(0)
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = threading.Thread(target=churn)
t.start()
t.join()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


def _churn(malloc: str | None) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("FRACTAL_MALLOC", "GLIBC_TUNABLES")}
    env["PYTHONPATH"] = str(ROOT)
    if malloc is not None:
        env["FRACTAL_MALLOC"] = malloc
    p = subprocess.run([sys.executable, "-c", _CHURN], env=env, capture_output=True, text=True, timeout=120,
                       check=True)
    tuned, faults = p.stdout.split()
    return tuned == "True", int(faults)


def test_tuned_allocator_keeps_frame_buffers_in_the_heap():
    tuned, faults = _churn(None)
    system, faults_system = _churn("system")
    assert tuned and not system  # glibc here; FRACTAL_MALLOC=system keeps glibc's defaults
    # measured: ~12,900 faults with glibc's defaults, ~450 tuned
    assert faults_system > 4000 and faults * 5 < faults_system, (faults, faults_system)


def test_child_env_passes_the_settings_as_glibc_tunables(monkeypatch):
    from fractal.heap import MMAP_THRESHOLD, child_env

    monkeypatch.delenv("FRACTAL_MALLOC", raising=False)
    env = child_env({"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "X": "1"})
    assert env["X"] == "1"
    assert env["GLIBC_TUNABLES"].startswith("glibc.pthread.rseq=0:glibc.malloc.mmap_threshold="
                                            f"{MMAP_THRESHOLD}:")
    monkeypatch.setenv("FRACTAL_MALLOC", "system")
    assert "GLIBC_TUNABLES" not in child_env({"X": "1"})


def test_mosquitto_started_here_gets_them():
    from federation.broker import start_mosquitto

    broker = start_mosquitto()
    try:
        environ = Path(f"/proc/{broker.pid}/environ").read_bytes().split(b"\0")
        assert any(e.startswith(b"GLIBC_TUNABLES=") and b"glibc.malloc.mmap_threshold=" in e for e in environ)
    finally:
        broker.close()
