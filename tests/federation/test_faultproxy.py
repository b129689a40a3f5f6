"""The fault proxy itself (harness/faultproxy.py) against a plain TCP echo server: added delay is
measured, cuts and partitions are seen by the client, a blackhole holds bytes until healed, the
periodic dropper cuts, and the control socket/CLI drives a standalone proxy."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.faultproxy import PartitionMode, ProxyThread, ctl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A threaded TCP echo server on loopback."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve(c: socket.socket) -> None:
        with c:
            while data := c.recv(65536):
                c.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield int(srv.getsockname()[1])
    stop.set()
    t.join(2)
    srv.close()


@pytest.fixture
def proxy(echo_port: int) -> Iterator[ProxyThread]:
    with ProxyThread("127.0.0.1", echo_port) as p:
        yield p


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _rtt(s: socket.socket, payload: bytes = b"ping") -> float:
    t0 = time.perf_counter()
    s.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = s.recv(65536)
        assert chunk, "connection closed"
        got += chunk
    assert got == payload
    return time.perf_counter() - t0


def test_passes_bytes_and_adds_measured_delay(proxy: ProxyThread) -> None:
    with _connect(proxy.port) as s:
        base = min(_rtt(s) for _ in range(5))
        assert base < 0.05
        proxy.set_delay(50, 30)  # one way each: the round trip gains 80 ms
        rtts = [_rtt(s) for _ in range(5)]
        assert all(0.078 <= r < 0.3 for r in rtts), rtts
        big = bytes(range(256)) * 2000  # order and content survive the delay line
        assert _rtt(s, big) >= 0.078
        proxy.set_delay(0)
        assert min(_rtt(s) for _ in range(3)) < 0.05
    d = proxy.describe()
    assert d["accepted"] == 1 and d["bytes_up"] == d["bytes_down"] > 512000


def test_cut_resets_open_connections(proxy: ProxyThread) -> None:
    a, b = _connect(proxy.port), _connect(proxy.port)
    with a, b:
        _rtt(a), _rtt(b)
        assert proxy.cut() == 2
        for s in (a, b):
            try:
                assert s.recv(10) == b""
            except ConnectionResetError:
                pass
    with _connect(proxy.port) as c:  # a cut is not a partition: new connections work
        _rtt(c)
    assert proxy.describe()["cut"] == 2


def test_refuse_partition_closes_new_connections_until_healed(proxy: ProxyThread) -> None:
    with _connect(proxy.port) as a:
        _rtt(a)
        proxy.partition(PartitionMode.REFUSE)
        with pytest.raises((ConnectionResetError, AssertionError, BrokenPipeError)):
            _rtt(a)
    with _connect(proxy.port) as b, pytest.raises((ConnectionResetError, AssertionError, BrokenPipeError)):
        _rtt(b)
    proxy.heal()
    with _connect(proxy.port) as c:
        _rtt(c)
    assert proxy.describe()["refused"] >= 1


def test_blackhole_holds_bytes_until_healed(proxy: ProxyThread) -> None:
    with _connect(proxy.port) as a:
        _rtt(a)
        proxy.partition(PartitionMode.BLACKHOLE)
        a.sendall(b"held")
        a.settimeout(0.5)
        with pytest.raises(TimeoutError):
            a.recv(10)  # nothing comes back while partitioned (0.5 s is the assertion's window)
        with _connect(proxy.port) as b:  # a new connection is accepted but hangs too
            b.settimeout(0.3)
            b.sendall(b"new")
            with pytest.raises(TimeoutError):
                b.recv(10)
            proxy.heal()
            b.settimeout(5)
            assert b.recv(10) == b"new"
        a.settimeout(5)
        assert a.recv(10) == b"held"


def test_a_connection_given_up_during_a_blackhole_never_reaches_the_target() -> None:
    """As on a real network, where the late SYN-ACK meets a reset: a client that connected during
    the blackhole and closed before it healed must not have its bytes (an MQTT CONNECT, say)
    delivered to the server afterwards; one that is still there gets its early bytes first."""
    srv = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []
    got = threading.Condition()

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                data = b""
                while chunk := c.recv(100):
                    data += chunk
                    if data.endswith(b"!"):
                        c.sendall(b"ok")
                with got:
                    seen.append(data)
                    got.notify_all()

    threading.Thread(target=serve, daemon=True).start()
    with ProxyThread("127.0.0.1", srv.getsockname()[1]) as proxy:
        proxy.partition(PartitionMode.BLACKHOLE)
        dead = _connect(proxy.port)
        dead.sendall(b"dead CONNECT")
        dead.close()
        with _connect(proxy.port) as live:
            live.sendall(b"live ")
            deadline = time.monotonic() + 5  # the proxy noticed the dead one give up: one left open
            while proxy.describe()["open"] != 1:
                assert time.monotonic() < deadline, proxy.describe()
                time.sleep(0.01)
            proxy.heal()
            live.sendall(b"CONNECT!")
            live.settimeout(5)
            assert live.recv(10) == b"ok"
        with got:
            assert got.wait_for(lambda: len(seen) == 1, 5)
        assert seen == [b"live CONNECT!"] and proxy.describe()["accepted"] == 2
    srv.close()


def test_periodic_drop_cuts_repeatedly(proxy: ProxyThread) -> None:
    proxy.drop_every(0.2)
    deadline = time.monotonic() + 5
    while proxy.describe()["cut"] < 2:
        with _connect(proxy.port) as s:
            s.settimeout(5)
            try:
                while s.recv(10) != b"":
                    pass
            except ConnectionResetError:
                pass  # this connection was dropped
        assert time.monotonic() < deadline
    proxy.drop_every(None)
    with _connect(proxy.port) as s:
        _rtt(s)


def test_standalone_proxy_controlled_over_its_socket(echo_port: int, tmp_path: Path) -> None:
    sock = str(tmp_path / "ctl.sock")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "harness.faultproxy", "serve",
                             "--listen", f"127.0.0.1:{port}", "--target", f"127.0.0.1:{echo_port}",
                             "--control", sock], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("faultproxy: ")
        out = ctl(sock, ["delay", "40"])
        assert out["ok"] and out["delay_ms"] == [40.0, 40.0]
        with _connect(port) as s:
            assert _rtt(s) >= 0.078
            cli = subprocess.run([sys.executable, "-m", "harness.faultproxy", "ctl", sock, "cut"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=30)
            assert cli.returncode == 0 and '"cut": 1' in cli.stdout
        bad = subprocess.run([sys.executable, "-m", "harness.faultproxy", "ctl", sock, "explode"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30)
        assert bad.returncode == 1 and bad.stderr.startswith("error: unknown command 'explode'")
    finally:
        proc.terminate()
        proc.wait(10)
