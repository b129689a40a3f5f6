"""`fractal fleet` as a real process: serves the API with the token from the environment, stops
on SIGTERM; a bad broker URL is one clear error line."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from api.fleet.serve import wait_for_leader
from federation.broker import free_port
from tests.fleet.swarm_proc import FRACTAL

pytestmark = pytest.mark.mosquitto


def test_fleet_cli_serves_and_stops_on_sigterm(broker):
    port = free_port()
    env = {**os.environ, "FRACTAL_FLEET_TOKEN": "cli-token", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([FRACTAL, "fleet", "--broker", broker.url, "--port", str(port), "--swarm", "cli"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == f"fleet dashboard: http://127.0.0.1:{port}/", line
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/api/health").json()["broker_connected"] is True
        assert wait_for_leader(base, 10)  # a fleet on its own SQLite file leads: a standby's wait ends
        assert httpx.get(base + "/api/nodes").status_code == 401
        r = httpx.get(base + "/api/nodes", headers={"Authorization": "Bearer cli-token"})
        assert r.status_code == 200 and r.json()["nodes"] == []
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_fleet_cli_bad_broker_url_is_one_line(tmp_path):
    proc = subprocess.run([FRACTAL, "fleet", "--broker", "http://nowhere", "--token", "t",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: bad broker URL 'http://nowhere': scheme must be mqtt or mqtts "
        "(help: use mqtt://[user:pass@]host:port or mqtts://[user:pass@]host:port)"]


def test_fleet_cli_port_in_use_is_one_line(broker):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([FRACTAL, "fleet", "--broker", broker.url, "--token", "t", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}") and "--port" in proc.stderr


def test_fleet_cli_bad_settings_are_one_line():
    env = {**os.environ, "FRACTAL_FLEET_ROUND_START_TIMEOUT_S": "-1"}
    for argv, env_, want in [
        (["--swarm", "bad id"], os.environ,
         "error: invalid setting swarm: Value error, invalid swarm id 'bad id'"),
        ([], env, "error: invalid setting round_start_timeout_s: Input should be greater than 0"),
        (["--async-params", "/nope"], os.environ, "error: cannot read async version 0 from /nope"),
    ]:
        proc = subprocess.run([FRACTAL, "fleet", "--broker", "mqtt://127.0.0.1:1", "--token", "t", *argv],
                              capture_output=True, text=True, timeout=60, env=env_)
        assert proc.returncode == 1 and proc.stderr.startswith(want), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_standby_waits_for_the_other_process_to_lead_and_gives_up_in_time():
    """--standby-for's wait: a follower's answer and a refused connection are waited out; a leader's
    ends it; with nobody leading it gives up after its timeout (the standby then contends)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = iter(["follower", "follower", "leader"])
    asked = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            role = next(answers, "leader")
            asked.append((self.path, role))
            body = json.dumps({"status": "ok", "role": role}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Health) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            assert wait_for_leader(f"http://127.0.0.1:{server.server_port}/", 30, poll_s=0.01)
        finally:
            server.shutdown()
    assert asked == [("/api/health", "follower"), ("/api/health", "follower"), ("/api/health", "leader")]
    t0 = time.monotonic()
    assert not wait_for_leader(f"http://127.0.0.1:{free_port()}", 0.5, poll_s=0.05)  # nobody there
    assert 0.5 <= time.monotonic() - t0 < 10


def test_fleet_cli_standby_for_needs_a_shared_database():
    for argv, want in [
        (["--standby-for", "http://127.0.0.1:8080"],
         "error: --standby-for needs --database (PostgreSQL shared with the other fleet process)"),
        (["--standby-for", "fleet:8080", "--database", "postgresql://u@h/db"],
         "error: bad --standby-for URL"),
    ]:
        proc = subprocess.run([FRACTAL, "fleet", "--broker", "mqtt://127.0.0.1:1", "--token", "t",
                               "--port", str(free_port()), *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(want), proc.stderr
