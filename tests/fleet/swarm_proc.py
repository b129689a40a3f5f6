"""Run `fractal swarm` as a real subprocess for the end-to-end and browser tests."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from federation.broker import free_port

FRACTAL = str(Path(sys.executable).with_name("fractal"))


@dataclass
class SwarmProc:
    proc: subprocess.Popen
    port: int
    token: str
    lines: list[str] = field(default_factory=list)
    url: str = ""

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return "\n".join(self.lines)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def interrupt(self, timeout: float = 40.0) -> int:
        """SIGINT (what Ctrl-C sends) and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for p in self.descendants():
                p.kill()
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(f"fractal swarm did not stop within {timeout}s:\n{self.output()}") from None


def assert_no_orphans(children: list[psutil.Process]) -> None:
    """Every process the swarm started (``SwarmProc.descendants`` before the stop) has exited."""
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"orphans left behind: {[(p.pid, p.name()) for p in alive]}"


def start_swarm(nodes: int, cache_dir: Path, token: str, *, timeout: float = 180.0,
                extra: tuple[str, ...] = ()) -> SwarmProc:
    """Start `fractal swarm` and return once it printed the dashboard URL."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([FRACTAL, "swarm", "--nodes", str(nodes), "--port", str(port), "--token", token,
                             "--cache-dir", str(cache_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            stdin=subprocess.DEVNULL)
    sp = SwarmProc(proc, port, token)
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            sp.lines.append(line.rstrip("\n"))
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError(f"fractal swarm exited early ({proc.wait()}):\n{sp.output()}")
        m = re.search(r"dashboard:\s+(http://\S+)", line)
        if m:
            sp.url = m.group(1)
            return sp
    sp.interrupt()
    raise AssertionError(f"no dashboard URL within {timeout}s:\n{sp.output()}")
