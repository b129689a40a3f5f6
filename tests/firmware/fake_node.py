"""A stand-in for `fractal node` that `fractal boot` starts (``python fake_node.py node --config CFG``):
it serves readiness (with the boot id of its config) and answers the reference inference of the
slot it was started from. On the slot named by FAKE_BAD_SLOT it answers as FAKE_MODE says:

    list     a JSON list instead of the reply object
    shape    an output whose data does not fit its shape
    nooutput an object without an 'outputs' list
    trickle  a reply sent one byte every FAKE_TRICKLE_S seconds (Content-Length of a full reply)

It writes its pid to DATA_DIR/fake-node-<slot>.pid, so a test can check it was stopped.
"""

from __future__ import annotations

import http.server
import json
import os
import sys
import time
import tomllib
from pathlib import Path

import numpy as np


def main() -> None:
    cfg = tomllib.loads(Path(sys.argv[sys.argv.index("--config") + 1]).read_text())
    slot_dir = Path(cfg["artifact"]).parent
    slot = slot_dir.name
    Path(cfg["data_dir"]).mkdir(parents=True, exist_ok=True)
    (Path(cfg["data_dir"]) / f"fake-node-{slot}.pid").write_text(str(os.getpid()))
    mode = os.environ.get("FAKE_MODE", "") if slot == os.environ.get("FAKE_BAD_SLOT") else "ok"
    trickle_s = float(os.environ.get("FAKE_TRICKLE_S", "2"))
    with np.load(slot_dir / "health" / "expected.npz") as z:
        good = {"outputs": [{"name": k, "datatype": "FP32", "shape": list(z[k].shape),
                             "data": z[k].ravel().tolist()} for k in z.files]}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, body: bytes, trickle: bool = False) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if self.path.endswith("/ready") and cfg.get("boot_id"):
                self.send_header("Fractal-Boot-Id", cfg["boot_id"])
            self.end_headers()
            if not trickle:
                self.wfile.write(body)
                return
            for b in body:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(trickle_s)

        def do_GET(self) -> None:
            self._send(b'{"ready":true}')

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if mode == "list":
                self._send(b"[1, 2, 3]")
            elif mode == "shape":
                bad = json.loads(json.dumps(good))
                bad["outputs"][0]["data"] = bad["outputs"][0]["data"][:3]
                self._send(json.dumps(bad).encode())
            elif mode == "nooutput":
                self._send(b'{"outputs": {"y": 1}}')
            elif mode == "trickle":  # 32 bytes: 64 s at one byte every 2 s
                self._send(b'{"outputs":[],"pad":"xxxxxxxxx"}', trickle=True)
            else:
                self._send(json.dumps(good).encode())

    srv = http.server.ThreadingHTTPServer((cfg.get("host", "127.0.0.1"), int(cfg["port"])), Handler)
    srv.daemon_threads = True
    srv.serve_forever()


if __name__ == "__main__":
    main()
