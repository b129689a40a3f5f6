"""Closed-loop load generation: N clients, each issuing its next request when the last one returns.

HTTP clients are raw keep-alive sockets (one per client) with a pre-built request, so the figures
measure the server rather than the client.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Stats", "summarize", "run_closed_loop", "http_caller"]

Stats = dict[str, Any]


def summarize(latencies_s: list[float], wall_s: float, errors: int = 0) -> Stats:
    """p50/p90/p99/max in milliseconds, requests per second, count and errors."""
    lat = sorted(latencies_s)
    if not lat:
        return {"n": 0, "errors": errors}

    def pct(p: float) -> float:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3, 4)

    return {"n": len(lat), "errors": errors, "p50_ms": pct(0.50), "p90_ms": pct(0.90), "p99_ms": pct(0.99),
            "max_ms": round(lat[-1] * 1e3, 4), "mean_ms": round(statistics.fmean(lat) * 1e3, 4),
            "req_per_s": round(len(lat) / wall_s, 1)}


def run_closed_loop(make_caller: Callable[[], Callable[[], None]], *, clients: int, duration_s: float,
                    warmup_s: float = 0.3, keep: list[float] | None = None) -> Stats:
    """Run ``clients`` threads, each calling its own caller in a loop for ``duration_s``.

    ``make_caller()`` is called once per client (e.g. to open its connection); a caller raises
    on failure, which is counted as an error. Latencies from the warm-up are discarded; the
    measured ones are also appended to ``keep`` if given (to pool several short segments).
    """
    callers = [make_caller() for _ in range(clients)]
    lats: list[list[float]] = [[] for _ in range(clients)]
    errs = [0] * clients
    start = threading.Barrier(clients + 1)
    t_measure = [0.0]
    t_end = [0.0]

    def loop(i: int) -> None:
        call, out = callers[i], lats[i]
        start.wait()
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end[0]:
                return
            try:
                call()
            except Exception:  # noqa: BLE001 - a failed request is a data point, not a crash
                errs[i] += 1
                continue
            if t0 >= t_measure[0]:
                out.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    now = time.perf_counter()
    t_measure[0] = now + warmup_s
    t_end[0] = t_measure[0] + duration_s
    start.wait()
    for t in threads:
        t.join(duration_s + warmup_s + 60)
    closers = [getattr(c, "close", None) for c in callers]
    for c in closers:
        if c:
            c()
    flat = [x for per in lats for x in per]
    if keep is not None:
        keep.extend(flat)
    return summarize(flat, duration_s, sum(errs))


class _HttpCaller:
    """One keep-alive connection POSTing one pre-built request; raises on a non-200 answer.

    Raw socket with minimal parsing instead of ``http.client``, whose header parsing (the
    ``email`` package) costs more per request than the server's whole routing: on a 2-core box
    the client and the server share the CPU, so a heavy client inflates the server's figures.
    """

    def __init__(self, host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> None:
        self.sock = socket.create_connection((host, port), timeout=30)
        # No Nagle: the request goes out in one segment, and the response is not held back either.
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = {"Host": f"{host}:{port}", "Content-Type": "application/json",
                "Content-Length": str(len(body)), **headers}
        self.request = (f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
                        + "\r\n").encode() + body
        self.buf = b""

    def __call__(self) -> None:
        self.sock.sendall(self.request)
        buf = self.buf
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += self._recv()
        head = buf[:end].decode("latin-1")
        status = int(head[9:12])
        length = 0
        for line in head.split("\r\n")[1:]:
            if line[:15].lower() == "content-length:":
                length = int(line[15:])
                break
        need = end + 4 + length
        while len(buf) < need:
            buf += self._recv()
        body, self.buf = buf[end + 4:need], buf[need:]
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:200]!r}")

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


def http_caller(host: str, port: int, path: str, body: bytes,
                headers: dict[str, str] | None = None) -> Callable[[], Callable[[], None]]:
    """A ``make_caller`` for :func:`run_closed_loop` that POSTs ``body`` to ``path``."""
    return lambda: _HttpCaller(host, port, path, body, headers or {})
