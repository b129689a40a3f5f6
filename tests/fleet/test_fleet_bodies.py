"""Issue 26, finding 1: the fleet refuses a request before it reads the body.

A real `fractal fleet` process; the attacker streams a 256 MiB body, generated lazily, over a raw
socket. Without the token the answer is 401 at once (nothing of the body read); with it, or on
/api/login (the open route that takes a token), 413 once the route's small limit is passed. The
fleet's peak memory (VmHWM from /proc) must not move by more than a few tens of MB, where reading
such a body used to cost hundreds.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from federation.broker import free_port
from tests.fleet.swarm_proc import FRACTAL

pytestmark = pytest.mark.mosquitto

TOKEN = "bodies-token"
ATTACK = 256 << 20  # bytes offered per request
MIB = 1 << 20


def _mem_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of ``pid``, in KiB, from /proc."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def _lazy_chunks(total: int, size: int = MIB, *, chunked: bool) -> Iterator[bytes]:
    """``total`` bytes of JSON-looking junk, one ``size`` block at a time (never all in memory)."""
    block = b"1" * size
    for _ in range(total // size):
        yield f"{size:x}\r\n".encode() + block + b"\r\n" if chunked else block
    if chunked:
        yield b"0\r\n\r\n"


def _complete(data: bytes) -> bool:
    """Has ``data`` a whole response (head and the body its Content-Length announces)?"""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return True


def _attack(port: int, path: str, *, token: str | None = None, chunked: bool = True,
            timeout: float = 60.0) -> tuple[int, int, float, bytes]:
    """POST a 256 MiB body to ``path``; returns (status, body bytes sent, seconds, response)."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {ATTACK}"
    head = (f"POST {path} HTTP/1.1\r\nHost: fleet\r\nContent-Type: application/json\r\n{auth}"
            f"{length}\r\n\r\n").encode()
    sent = 0
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        for chunk in _lazy_chunks(ATTACK, chunked=chunked):
            # Stop once the server answered: unread data left behind makes the close a RST,
            # which could eat the answer.
            if select.select([s], [], [], 0)[0]:
                break
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        data = b""
        while not _complete(data):
            try:
                part = s.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            data += part
    elapsed = time.monotonic() - t0
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, sent, elapsed, data


@pytest.fixture
def fleet_proc(broker, tmp_path):
    port = free_port()
    env = {**os.environ, "FRACTAL_FLEET_TOKEN": TOKEN, "FRACTAL_FLEET_DB": str(tmp_path / "fleet.sqlite"),
           "FRACTAL_FLEET_IMAGES_DIR": str(tmp_path / "images"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([FRACTAL, "fleet", "--broker", broker.url, "--port", str(port), "--swarm",
                             f"bodies-{port}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("fleet dashboard:"), line
        # warm up the routes once (imports, first-request allocations) before measuring
        for p in ("/api/rounds", "/api/login", "/api/images"):
            httpx.post(f"http://127.0.0.1:{port}{p}", json={"steps": 1}, timeout=10)
        yield proc, port
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
def test_huge_bodies_are_refused_before_they_are_read(fleet_proc, chunked):
    proc, port = fleet_proc
    before = _mem_kib(proc.pid)
    cases = [
        ("/api/rounds", None, 401),  # no token: refused on the headers
        ("/api/rollback", None, 401),
        ("/api/images", None, 401),  # the image upload route too (its limit is the image size)
        ("/api/logout", None, 401),
        ("/api/login", None, 413),  # open (it takes the token), but its limit is tiny
        ("/api/rounds", TOKEN, 413),  # with the token: the route's small limit
    ]
    for path, token, want in cases:
        status, sent, seconds, resp = _attack(port, path, token=token, chunked=chunked)
        assert status == want, (path, token, resp[:300])
        assert b'"error"' in resp or b'"detail"' in resp, resp[:300]
        assert sent < 32 * MIB, f"{path}: the client could push {sent >> 20} MiB before the answer"
        assert seconds < 10, f"{path}: answered after {seconds:.1f} s"
        assert proc.poll() is None
    after = _mem_kib(proc.pid)
    grew = (after["VmHWM"] - before["VmHWM"]) // 1024
    assert grew < 40, f"the fleet's peak RSS grew by {grew} MiB ({before} -> {after})"
    assert after["VmRSS"] - before["VmRSS"] < 40 * 1024, (before, after)
    # still serving, and a normal request still works
    r = httpx.get(f"http://127.0.0.1:{port}/api/nodes", headers={"Authorization": f"Bearer {TOKEN}"},
                  timeout=10)
    assert r.status_code == 200, r.text


def test_route_limits_do_not_refuse_ordinary_requests(fleet_proc):
    _, port = fleet_proc
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # login with the token: 200 and the cookie; a wrong one 401
    r = httpx.post(base + "/api/login", json={"token": TOKEN}, timeout=10)
    assert r.status_code == 200 and "fractal_fleet_token" in r.headers.get("set-cookie", "")
    assert httpx.post(base + "/api/login", json={"token": "nope"}, timeout=10).status_code == 401
    # the cookie authenticates a POST too (what the dashboard sends)
    r = httpx.post(base + "/api/logout", cookies={"fractal_fleet_token": TOKEN}, timeout=10)
    assert r.status_code == 200, r.text
    # a round request naming 1,024 nodes (the API's bound) fits the JSON limit: refused because
    # no such nodes exist, not 413
    r = httpx.post(base + "/api/rounds", json={"steps": 1, "nodes": [f"node-{i:059d}" for i in range(1024)]},
                   headers=auth, timeout=10)
    assert r.status_code in (404, 409, 422), r.text[:300]
    # a declared length over the route's limit: 413 naming the limit, nothing read
    r = httpx.post(base + "/api/rounds", content=b"x" * (300 << 10), headers=auth, timeout=10)
    assert r.status_code == 413 and "limit" in r.json()["error"], r.text
    # health stays open
    assert httpx.get(base + "/api/health", timeout=10).status_code == 200
