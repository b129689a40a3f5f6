"""A request body that trickles in (slowloris) is cut off with 408 instead of holding a worker."""

from __future__ import annotations

import socket
import time

from api.node_app import create_node_app
from api.serving import ServerThread


def test_slow_body_gets_408(api_node):
    with ServerThread(create_node_app(api_node, body_timeout_s=0.5)) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        head = (b"POST /v1/samples HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n")
        t0 = time.monotonic()
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(head + b'{"inputs": ')  # then nothing more
            data = b""
            while not data.endswith(b"}"):
                part = s.recv(65536)
                if not part:
                    break
                data += part
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert b"did not arrive within 0.5 s" in data
        assert time.monotonic() - t0 < 5
        # A normal request on a new connection is still served.
        import httpx

        assert httpx.get(srv.url + "/v2/health/live").status_code == 200
