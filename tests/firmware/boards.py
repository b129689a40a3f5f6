"""Boards for over-the-air tests: device directories flashed with an image, each run by a real
``fractal boot`` process whose node joins a fleet's swarm on a real broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.edgenode.test_cli_node import free_port
from tests.firmware.conftest import CLI, REPO, cli


@dataclass
class Board:
    node_id: str
    device: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    def state(self) -> dict:
        return json.loads((self.device / "data" / "boot-state.json").read_text())

    def log(self) -> str:
        """The supervisor's output and the node logs, for assertion messages."""
        out = [(self.device.parent / f"{self.node_id}.boot.log").read_text(errors="replace")]
        logs = sorted((self.device / "data").glob("node-*.log"))
        out += [p.read_text(errors="replace")[-3000:] for p in logs]
        return "\n".join(out)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def make_board(tmp: Path, node_id: str, image: Path, pubkey: Path | str, broker_url: str, swarm: str,
               extra: str = "") -> Board:
    """Flash ``image`` into a new device ``tmp/node_id`` and start ``fractal boot`` for it
    (``extra``: more NODE.toml lines for every slot, e.g. the signed swarm's key files)."""
    device = tmp / node_id
    r = cli("image", "flash", image, "--device", device, "--pubkey", pubkey)
    assert r.returncode == 0, r.stderr
    (device / "data" / "node.extra.toml").write_text(
        f'broker = "{broker_url}"\nswarm = "{swarm}"\nheartbeat_s = 1.0\nkeepalive_s = 5\n{extra}'
    )
    board = Board(node_id, device, free_port())
    with open(tmp / f"{node_id}.boot.log", "wb") as logf:
        board.proc = subprocess.Popen(
            [*CLI, "boot", "--device", str(device), "--port", str(board.port), "--health-timeout", "180"],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return board
