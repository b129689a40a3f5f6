"""A small TCP fault proxy: put it between MQTT clients and the broker to add network faults.

Faults (all switchable while connections are open):

* ``set_delay(up_ms, down_ms)``: added one-way latency per direction (client->target is "up").
  Bytes keep their order; the delay is latency, not a bandwidth limit.
* ``cut()``: reset every open connection now (both sides see the socket die, like a NAT or
  Wi-Fi dropping the flow).
* ``partition(mode)``: until ``heal()``. ``REFUSE``: existing connections are reset, new ones are
  closed at once (the far host is unreachable and says so). ``BLACKHOLE``: nothing is forwarded
  in either direction and new connections are accepted but hang (packets silently lost; TCP
  would retransmit, so on ``heal()`` held bytes flow again unless a keepalive gave up first).
* ``drop_every(seconds)``: cut all connections periodically (``None`` stops it).

Use :class:`FaultProxy` inside an asyncio loop, or :class:`ProxyThread` from synchronous code
(tests): it runs the loop in a thread, optionally inside a Linux network namespace (the sockets
are then created there). ``python -m harness.faultproxy serve --listen H:P --target H:P --control
SOCK`` runs it standalone; ``python -m harness.faultproxy ctl SOCK delay 50 50`` (``cut``,
``partition blackhole``, ``heal``, ``drop-every 5``, ``drop-every off``, ``stats``) controls it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from harness.netns import enter_netns

__all__ = ["FaultProxy", "ProxyThread", "PartitionMode", "ProxyStats", "main"]

_CHUNK = 65536
T = TypeVar("T")


class PartitionMode(enum.StrEnum):
    REFUSE = "refuse"  # resets: the peer learns at once
    BLACKHOLE = "blackhole"  # silence: the peer learns only from its own timeouts


@dataclass
class ProxyStats:
    accepted: int = 0
    refused: int = 0  # new connections closed by a REFUSE partition or an unreachable target
    cut: int = 0  # connections reset by cut(), drop_every or a REFUSE partition
    open: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class _Conn:
    """One proxied connection: two pumps, each with its own delay line."""

    def __init__(self, proxy: FaultProxy, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.cr, self.cw = cr, cw
        self.tw: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    async def run(self) -> None:
        p = self.proxy
        early = await self._hang()  # a blackholed SYN "hangs" until the network heals
        if early is None:
            return
        try:
            tr, self.tw = await asyncio.open_connection(p.target_host, p.target_port)
        except OSError:
            p.stats.refused += 1
            self.abort()
            return
        if self.closed:  # cut while connecting
            self.tw.transport.abort()
            return
        if early:
            self.tw.write(early)
        self.tasks = [asyncio.create_task(self._pump(self.cr, self.tw, up=True)),
                      asyncio.create_task(self._pump(tr, self.cw, up=False))]
        await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        self.abort()

    async def _hang(self) -> bytes | None:
        """Wait while the network is blackholed, like a SYN nobody answers; returns what the
        client sent meanwhile, or None if it gave up (closed or reset) before the network healed.
        On a real network such a connection never reaches the server: its client's kernel
        answers the late SYN-ACK with a reset. Forwarding it instead would replay a dead MQTT
        CONNECT to the broker, which then takes the session over from the client's live
        connection (same client id) and kicks it."""
        p, early = self.proxy, bytearray()
        while not p._flowing.is_set():
            read = asyncio.ensure_future(self.cr.read(_CHUNK))
            flow = asyncio.ensure_future(p._flowing.wait())
            try:
                await asyncio.wait({read, flow}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                flow.cancel()
            if not read.done():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await read
                continue
            try:
                data = read.result()
            except (OSError, asyncio.IncompleteReadError):
                data = b""
            if not data:
                self.abort()
                return None
            early += data
        return bytes(early)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool) -> None:
        p = self.proxy
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._deliver(line, writer, up=up))
        try:
            while not self.closed:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                delay = (p.delay_up_ms if up else p.delay_down_ms) / 1000.0
                line.put_nowait((time.monotonic() + delay, data))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            if not self.closed:
                await line.join()  # the peer closed: flush what is still in the delay line
            sender.cancel()

    async def _deliver(self, line: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter, *,
                       up: bool) -> None:
        p = self.proxy
        while True:
            due, data = await line.get()
            try:
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await p._flowing.wait()  # blackhole: hold the bytes (TCP would retransmit them)
                if self.closed:
                    return
                writer.write(data)
                await writer.drain()
                if up:
                    p.stats.bytes_up += len(data)
                else:
                    p.stats.bytes_down += len(data)
            except OSError:
                self.abort()
                return
            finally:
                line.task_done()

    def abort(self) -> None:
        """Reset both sockets (RST, not FIN: a dropped flow, not a polite close)."""
        if self.closed:
            return
        self.closed = True
        for w in (self.cw, self.tw):
            if w is not None:
                w.transport.abort()
        for t in self.tasks:
            t.cancel()


class FaultProxy:
    """A TCP proxy ``listen -> target`` with switchable faults (run it in one asyncio loop)."""

    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1",
                 listen_port: int = 0) -> None:
        self.target_host, self.target_port = target_host, target_port
        self.listen_host, self.listen_port = listen_host, listen_port
        self.delay_up_ms = 0.0
        self.delay_down_ms = 0.0
        self.partitioned: PartitionMode | None = None
        self.stats = ProxyStats()
        self._conns: set[_Conn] = set()
        self._server: asyncio.base_events.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._dropper: asyncio.Task[None] | None = None
        self.drop_every_s: float | None = None

    async def start(self) -> int:
        """Listen; returns the bound port."""
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)
        self.listen_port = int(self._server.sockets[0].getsockname()[1])
        return self.listen_port

    async def stop(self) -> None:
        self.drop_every(None)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.cut()

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self.partitioned is PartitionMode.REFUSE:
            self.stats.refused += 1
            cw.transport.abort()
            return
        sock = cw.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.stats.accepted += 1
        conn = _Conn(self, cr, cw)
        self._conns.add(conn)
        self.stats.open = len(self._conns)
        try:
            await conn.run()
        except asyncio.CancelledError:  # loop shutdown: asyncio's stream callback must not see it
            conn.abort()
        finally:
            self._conns.discard(conn)
            self.stats.open = len(self._conns)

    # -- faults ---------------------------------------------------------------------------
    def set_delay(self, up_ms: float, down_ms: float | None = None) -> None:
        """Added one-way latency (ms) for bytes sent from now on; ``down_ms`` defaults to ``up_ms``."""
        self.delay_up_ms = max(0.0, float(up_ms))
        self.delay_down_ms = max(0.0, float(up_ms if down_ms is None else down_ms))

    def cut(self) -> int:
        """Reset every open connection; returns how many."""
        conns = list(self._conns)
        for c in conns:
            c.abort()
        self.stats.cut += len(conns)
        return len(conns)

    def partition(self, mode: PartitionMode = PartitionMode.BLACKHOLE) -> None:
        self.partitioned = PartitionMode(mode)
        if self.partitioned is PartitionMode.REFUSE:
            self.cut()
        else:
            self._flowing.clear()

    def heal(self) -> None:
        self.partitioned = None
        self._flowing.set()

    def drop_every(self, seconds: float | None) -> None:
        """Cut all connections every ``seconds`` (``None`` or <= 0 stops)."""
        if self._dropper is not None:
            self._dropper.cancel()
            self._dropper = None
        self.drop_every_s = seconds if seconds and seconds > 0 else None
        if self.drop_every_s:
            self._dropper = asyncio.create_task(self._drop_loop(self.drop_every_s))

    async def _drop_loop(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            self.cut()

    def describe(self) -> dict[str, Any]:
        return {"listen": f"{self.listen_host}:{self.listen_port}",
                "target": f"{self.target_host}:{self.target_port}",
                "delay_ms": [self.delay_up_ms, self.delay_down_ms],
                "partition": self.partitioned.value if self.partitioned else None,
                "drop_every_s": self.drop_every_s, **asdict(self.stats)}


class ProxyThread:
    """A :class:`FaultProxy` in its own thread and loop; every method is callable from any thread."""

    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1",
                 listen_port: int = 0, netns: str | None = None) -> None:
        self._args = (target_host, target_port, listen_host, listen_port)
        self.netns = netns
        self.proxy: FaultProxy | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> ProxyThread:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                if self.netns:
                    enter_netns(self.netns)
                loop = asyncio.new_event_loop()
                asyncio.set_event_loop(loop)
                th, tp, lh, lp = self._args
                proxy = FaultProxy(th, tp, listen_host=lh, listen_port=lp)
                loop.run_until_complete(proxy.start())
            except BaseException as exc:  # reported to start()
                errors.append(exc)
                ready.set()
                return
            self._loop, self.proxy = loop, proxy
            ready.set()
            loop.run_forever()
            loop.run_until_complete(proxy.stop())
            pending = asyncio.all_tasks(loop)
            for t in pending:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name="faultproxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or errors:
            raise RuntimeError(f"fault proxy did not start: {errors[0] if errors else 'timeout'}")
        return self

    @property
    def port(self) -> int:
        assert self.proxy is not None
        return self.proxy.listen_port

    def call(self, fn: Callable[[FaultProxy], T], timeout: float = 5.0) -> T:
        """Run ``fn(proxy)`` on the proxy's loop and return its result."""
        assert self._loop is not None and self.proxy is not None, "start() first"
        proxy = self.proxy

        async def go() -> T:
            return fn(proxy)

        return asyncio.run_coroutine_threadsafe(go(), self._loop).result(timeout)

    def set_delay(self, up_ms: float, down_ms: float | None = None) -> None:
        self.call(lambda p: p.set_delay(up_ms, down_ms))

    def cut(self) -> int:
        return self.call(lambda p: p.cut())

    def partition(self, mode: PartitionMode = PartitionMode.BLACKHOLE) -> None:
        self.call(lambda p: p.partition(mode))

    def heal(self) -> None:
        self.call(lambda p: p.heal())

    def drop_every(self, seconds: float | None) -> None:
        self.call(lambda p: p.drop_every(seconds))

    def describe(self) -> dict[str, Any]:
        return self.call(lambda p: p.describe())

    def stop(self, timeout: float = 5.0) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
        self._loop = self._thread = self.proxy = None

    def __enter__(self) -> ProxyThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- standalone: serve + a line-based control socket ----------------------------------------------
def _apply(proxy: FaultProxy, words: list[str]) -> dict[str, Any]:
    """One control command -> the proxy's state after it (raises ValueError on a bad command)."""
    if not words:
        raise ValueError("empty command")
    cmd, args = words[0], words[1:]
    if cmd == "delay" and 1 <= len(args) <= 2:
        proxy.set_delay(float(args[0]), float(args[-1]))
    elif cmd == "cut" and not args:
        proxy.cut()
    elif cmd == "partition" and len(args) <= 1:
        proxy.partition(PartitionMode(args[0]) if args else PartitionMode.BLACKHOLE)
    elif cmd == "heal" and not args:
        proxy.heal()
    elif cmd == "drop-every" and len(args) == 1:
        proxy.drop_every(None if args[0] == "off" else float(args[0]))
    elif cmd != "stats" or args:
        raise ValueError(f"unknown command {' '.join(words)!r}")
    return proxy.describe()


async def _control(proxy: FaultProxy, path: str) -> asyncio.base_events.Server:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while line := await r.readline():
                try:
                    out: dict[str, Any] = {"ok": True, **_apply(proxy, line.decode(errors="replace").split())}
                except ValueError as exc:
                    out = {"ok": False, "error": str(exc)}
                w.write(json.dumps(out).encode() + b"\n")
                await w.drain()
        w.close()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return await asyncio.start_unix_server(handle, path)


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host or "127.0.0.1", int(port)


async def _serve(listen: str, target: str, control: str | None) -> None:
    (lh, lp), (th, tp) = _hostport(listen), _hostport(target)
    proxy = FaultProxy(th, tp, listen_host=lh, listen_port=lp)
    port = await proxy.start()
    ctl = await _control(proxy, control) if control else None
    print(f"faultproxy: {lh}:{port} -> {th}:{tp}" + (f" (control {control})" if control else ""), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        if ctl is not None:
            ctl.close()
        await proxy.stop()


def ctl(path: str, words: list[str], timeout: float = 5.0) -> dict[str, Any]:
    """Send one command to a running proxy's control socket; returns its JSON answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(" ".join(words).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
    return dict(json.loads(buf))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.faultproxy", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("serve", help="run the proxy")
    s.add_argument("--listen", required=True, help="HOST:PORT to accept on")
    s.add_argument("--target", required=True, help="HOST:PORT to forward to (the broker)")
    s.add_argument("--control", help="unix socket path for `ctl`")
    c = sub.add_parser("ctl", help="send a command to a running proxy")
    c.add_argument("socket")
    c.add_argument("words", nargs="+", help="delay UP [DOWN] | cut | partition [refuse|blackhole] | heal | "
                                             "drop-every S|off | stats")
    a = ap.parse_args(argv)
    try:
        if a.verb == "serve":
            with contextlib.suppress(KeyboardInterrupt):
                asyncio.run(_serve(a.listen, a.target, a.control))
            return 0
        out = ctl(a.socket, a.words)
    except (OSError, ValueError) as exc:
        print(f"error: {exc} (help: python -m harness.faultproxy --help)", file=sys.stderr)
        return 1
    print(json.dumps(out))
    if not out.get("ok"):
        print(f"error: {out.get('error')} (help: python -m harness.faultproxy ctl --help)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
