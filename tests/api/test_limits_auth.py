"""413 for oversized bodies without buffering them; bearer-token auth with health left open."""

from __future__ import annotations

import select
import socket

import httpx
import pytest

from tests.api.conftest import MAX_BODY, TOKEN


def _raw_request(url: str, head: bytes, chunks, timeout: float = 10.0) -> tuple[bytes, int]:
    """Send ``head`` then ``chunks`` until the server answers; returns (response bytes, bytes sent)."""
    host, port = url.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head)
        for chunk in chunks:
            # Stop as soon as the server has answered, so little unread data is left behind
            # (closing a socket with unread data sends a RST that may eat the response).
            if select.select([s], [], [], 0)[0]:
                break
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        s.settimeout(timeout)  # a server that kept waiting for the rest of the body times out here
        data = b""
        while True:  # the 413 says "connection: close": read to EOF
            try:
                part = s.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            data += part
    return data, sent


def test_declared_content_length_over_limit_is_refused_before_reading(server, api_node):
    # 1 GB declared, nothing sent: the answer must come without the server waiting for the body.
    head = (f"POST /v2/models/{api_node.model_name}/infer HTTP/1.1\r\nHost: t\r\n"
            f"Content-Type: application/json\r\nContent-Length: {1 << 30}\r\n\r\n").encode()
    resp, _ = _raw_request(server.url, head, [], timeout=5)
    assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
    assert b"max_body_bytes" in resp


@pytest.mark.parametrize("path", ["/v2/models/{model}/infer", "/v1/samples"])
def test_streamed_chunked_body_over_limit_is_cut_off(server, api_node, path):
    """A chunked body larger than the limit, never terminated: only a bounded prefix is read.

    If the app buffered the whole body it would wait for the final chunk forever (and the
    socket read below would time out); instead it answers 413 after ~max_body_bytes.
    """
    chunk = b"[" + b"0," * 8191 + b"0]"
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    n_frames = (4 * MAX_BODY) // len(chunk)  # 4x the limit offered, no terminating 0-chunk
    head = (f"POST {path.format(model=api_node.model_name)} HTTP/1.1\r\nHost: t\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    resp, _ = _raw_request(server.url, head, [frame] * n_frames, timeout=5)
    assert resp.startswith(b"HTTP/1.1 413"), resp[:300]
    assert b"stopped reading after" in resp


def test_chunked_body_under_limit_is_served(server, api_node, reference_infer):
    import numpy as np

    spec = api_node.inputs[0]
    x = np.linspace(-1, 1, spec.shape[1], dtype=np.float32)[None]
    tensor = {"name": spec.name, "shape": [1, spec.shape[1]], "datatype": "FP32", "data": x.ravel().tolist()}
    body = httpx.Request("POST", "/", json={"inputs": [tensor]}).read()
    r = httpx.post(f"{server.url}/v2/models/{api_node.model_name}/infer",
                   content=iter([body[:10], body[10:]]))  # iterator -> Transfer-Encoding: chunked
    assert r.status_code == 200, r.text
    out = api_node.outputs[0].name
    np.testing.assert_allclose(r.json()["outputs"][0]["data"], reference_infer(x)[out].ravel(), atol=1e-5)


def test_gzip_bomb_is_413(server, api_node):
    import gzip

    bomb = gzip.compress(b" " * (MAX_BODY * 8))  # ~2 MB of spaces -> a few KB compressed
    assert len(bomb) < MAX_BODY
    r = httpx.post(f"{server.url}/v2/models/{api_node.model_name}/infer", content=bomb,
                   headers={"content-encoding": "gzip"})
    assert r.status_code == 413 and "decompressed" in r.json()["error"]


def test_bearer_auth(auth_server, api_node):
    with httpx.Client(base_url=auth_server.url, timeout=10) as c:
        for path in ("/v2/health/live", "/v2/health/ready"):  # health stays open
            assert c.get(path).status_code == 200
        protected = ["/v2", f"/v2/models/{api_node.model_name}", f"/v2/models/{api_node.model_name}/ready",
                     "/v1/node", "/metrics", "/openapi.json"]
        for path in protected:
            r = c.get(path)
            assert r.status_code == 401 and "missing bearer token" in r.json()["error"], path
            assert r.headers["www-authenticate"].startswith("Bearer")
            r = c.get(path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and "invalid bearer token" in r.json()["error"], path
            r = c.get(path, headers={"Authorization": TOKEN})  # no "Bearer " scheme
            assert r.status_code == 401, path
            assert c.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200, path
        for path, body in ((f"/v2/models/{api_node.model_name}/infer", {"inputs": []}),
                           ("/v1/samples", {"inputs": {}, "labels": []})):
            assert c.post(path, json=body).status_code == 401
            # authorised but bad body: past auth, into validation
            assert c.post(path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 400


def _binary_infer(url: str, model: str, n: int) -> httpx.Response:
    import json

    import numpy as np

    blob = np.zeros((n, 64), np.float32).tobytes()
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [n, 64],
                                   "parameters": {"binary_data_size": len(blob)}}]}).encode()
    return httpx.post(f"{url}/v2/models/{model}/infer", content=head + blob, timeout=30,
                      headers={"Inference-Header-Content-Length": str(len(head)),
                               "Content-Type": "application/octet-stream"})


def test_batch_over_max_batch_is_413_naming_the_limit(server, api_node):
    limit = api_node.config.max_batch
    assert limit == 256 and (limit + 1) * 64 * 4 < MAX_BODY  # under the body limit: only max_batch trips
    ok = _binary_infer(server.url, api_node.model_name, limit)
    assert ok.status_code == 200, ok.text
    resp = _binary_infer(server.url, api_node.model_name, limit + 1)
    assert resp.status_code == 413, resp.text
    assert "max_batch (256)" in resp.json()["error"]
