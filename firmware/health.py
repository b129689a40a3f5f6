"""The boot health check: is the node *this boot started* ready, and does it answer the image's
reference inference within ``atol``?

Two rules make it trustworthy:

* one deadline for the whole check: every HTTP exchange ends by it whatever the server does (a
  reply trickled one byte at a time, a silent socket), because a timer shuts the socket down
  when the deadline passes; replies are bounded in size;
* only the launched process counts: ``fractal boot`` writes a fresh ``boot_id`` into the node's
  config and the node returns it in the ``Fractal-Boot-Id`` header of ``/v2/health/ready``; a
  ready answer without it comes from another process (a node left running by a killed
  supervisor) and is never taken for this slot's.

Every failure is a one-line reason (the slot fails its check); nothing here raises on a bad reply.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np

from firmware.manifest import HealthSpec
from fractal.oip import TensorError, decode_json_tensor, json_tensor, loads

__all__ = ["BOOT_ID_HEADER", "MAX_REPLY", "health_check"]

BOOT_ID_HEADER = "Fractal-Boot-Id"
MAX_REPLY = 16 << 20  # the reference output of an edge model is kilobytes
_POLL_S = 0.2


class _Expired(Exception):
    pass


def _request(url: str, deadline: float, body: bytes | None = None,
             token: str | None = None) -> tuple[int, str | None, bytes]:
    """(status, boot id header, body) of one GET (or POST of JSON ``body``) that ends by ``deadline``
    (time.monotonic): _Expired when it does not, OSError / HTTPException when the exchange fails."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Expired
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=left)
    expired = threading.Event()
    lock = threading.Lock()
    sock: list[socket.socket] = []  # the connection's socket (the response keeps it after conn.close)

    def cut() -> None:  # a blocked read returns at once when its socket is shut down
        with lock:
            expired.set()
            for sk in sock:
                try:
                    sk.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    timer = threading.Timer(left, cut)
    timer.daemon = True
    timer.start()
    resp: http.client.HTTPResponse | None = None
    try:
        conn.connect()
        with lock:
            if conn.sock is not None:
                sock.append(conn.sock)
            if expired.is_set():
                raise _Expired
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        conn.request("POST" if body is not None else "GET", u.path or "/", body=body, headers=headers)
        resp = conn.getresponse()
        length = resp.getheader("Content-Length")
        if length is not None and length.isascii() and length.isdigit() and int(length) > MAX_REPLY:
            raise http.client.HTTPException(f"a reply of {length} bytes (more than {MAX_REPLY})")
        data = resp.read(MAX_REPLY + 1)
        if len(data) > MAX_REPLY:
            raise http.client.HTTPException(f"a reply of more than {MAX_REPLY} bytes")
        result = resp.status, resp.getheader(BOOT_ID_HEADER), data
    except (OSError, http.client.HTTPException):
        if expired.is_set():
            raise _Expired from None
        raise
    finally:
        timer.cancel()
        if resp is not None:
            resp.close()
        conn.close()
    if expired.is_set():  # what was read as the deadline passed does not count
        raise _Expired
    return result


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _outputs(data: bytes) -> dict[str, np.ndarray]:
    """The reply's outputs by name; TensorError naming what is wrong with its shape."""
    reply = loads(data)
    if not isinstance(reply, dict) or not isinstance(reply.get("outputs"), list):
        raise TensorError("the reply is not an object with an 'outputs' list")
    out: dict[str, np.ndarray] = {}
    for t in reply["outputs"]:
        name, arr = decode_json_tensor(t, "output")
        out[name] = arr
    return out


def _wait_ready(url: str, proc: subprocess.Popen[bytes], boot_id: str, deadline: float,
                timeout_s: float) -> str | None:
    impostor = False
    while True:
        if proc.poll() is not None:
            why = f"the node exited with code {proc.returncode} before it was ready"
            return why + (" (another process answers on its port)" if impostor else "")
        try:
            status, seen, _ = _request(f"{url}/v2/health/ready", min(deadline, time.monotonic() + 5.0))
            if status == 200:
                if seen == boot_id:
                    return None
                impostor = True  # ready, but not the node this boot started
        except (OSError, http.client.HTTPException, _Expired):
            pass
        if time.monotonic() >= deadline:
            why = f"the node was not ready within {timeout_s:.0f} s"
            return why + (" (another process answers on its port, not the node this boot started)"
                          if impostor else "")
        time.sleep(_POLL_S)


def health_check(url: str, slot_dir: Path, health: HealthSpec, proc: subprocess.Popen[bytes],
                 timeout_s: float, boot_id: str, token: str | None = None) -> str | None:
    """None when healthy, else why not; the whole check ends within ``timeout_s``. ``token``: the
    node's ``auth_token``, presented on the reference inference."""
    deadline = time.monotonic() + timeout_s
    why = _wait_ready(url, proc, boot_id, deadline, timeout_s)
    if why is not None or health.input is None or health.expected is None:
        return why  # no reference runtime for this arch at build time: readiness only
    try:
        inputs = _npz(slot_dir / health.input)
        expected = _npz(slot_dir / health.expected)
    except (OSError, ValueError) as exc:
        return f"the image's reference input cannot be read ({exc})"
    body: dict[str, Any] = {"inputs": [json_tensor(k, v) for k, v in inputs.items()]}
    model = urllib.parse.quote(health.model, safe="")
    try:
        # version 0: the image's own parameters, which the reference output was computed with
        # (the node's current version carries what it has learned since; api/routes/oip.py)
        status, seen, data = _request(f"{url}/v2/models/{model}/versions/0/infer", deadline,
                                      body=json.dumps(body).encode(), token=token)
    except _Expired:
        return f"the reference inference did not complete within the {timeout_s:.0f} s of the check"
    except (OSError, http.client.HTTPException) as exc:
        return f"the reference inference failed ({exc})"
    if proc.poll() is not None:
        return f"the node exited with code {proc.returncode} during the check"
    if status != 200:
        return f"the reference inference answered HTTP {status}"
    try:
        got = _outputs(data)
    except TensorError as exc:
        return f"the reference inference answered a malformed reply ({exc})"
    for name, want in expected.items():
        if name not in got or got[name].shape != want.shape:
            return f"the reference inference lacks output {name!r} of shape {list(want.shape)}"
        diff = got[name].astype(np.float64) - want.astype(np.float64)
        err = float(np.max(np.abs(diff))) if want.size else 0.0
        if not err <= health.atol:
            return f"output {name!r} differs from the image's expected output by {err:.3g} (> {health.atol})"
    return None
