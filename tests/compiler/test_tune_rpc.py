"""Tuning on a board through TVM's RPC server: an aarch64 `compiler.rpc_server` under qemu-user
stands in for a Raspberry Pi 4. Timings under emulation mean nothing; the test checks that
records are produced, stored under the board's target, and applied by a later compile that runs
no trials."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from compiler import tuning, zoo
from compiler.emulate import python_command
from compiler.importer import import_model
from compiler.rpc_server import READY
from compiler.targets import get_preset

TRIALS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def board_rpc() -> Iterator[str]:
    """``HOST:PORT`` of an aarch64 RPC server running under qemu-aarch64 (stopped afterwards)."""
    port = _free_port()
    cmd, env = python_command("aarch64", ["-m", "compiler.rpc_server", "--port", str(port),
                                          "--port-end", str(port + 20)])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = threading.Event()
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(READY):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(240), f"RPC server did not start: {''.join(lines)[-2000:]}"
        yield lines[-1].split()[-1] if lines[-1].startswith(READY) else f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_tune_on_emulated_board_then_compile_applies_records(board_rpc, run_cli, tmp_path):
    onnx_path = zoo.save("digits-mlp", tmp_path / "digits.onnx")
    db = tmp_path / "db"
    res = run_cli("tune", onnx_path, "--target", "rpi4", "--rpc", board_rpc, "--trials", TRIALS, "--db", db)
    assert res.code == 0, res.err
    assert "tuning: task 1/2" in res.err and "tuning: task 2/2" in res.err  # progress per task
    path = Path(res.out.strip().splitlines()[-1])
    # stored under the board's target (Cortex-A72), keyed like any database
    target = get_preset("rpi4").tvm_target()
    mod = import_model(zoo.build("digits-mlp")).mod
    assert path == tuning.database_path(mod, target, db, prepack=True)
    assert path.parent.name.startswith("llvm-aarch64-cortex-a72-")
    records = (path / "database_tuning_record.json").read_text().splitlines()
    assert len(records) >= 1
    meta = json.loads((path / "tune.json").read_text())
    assert meta["measured_on"] == f"rpc://{board_rpc}" and meta["trials_run"] == TRIALS
    assert sorted(meta["per_task"].values()) == [TRIALS // 2, TRIALS // 2]  # an equal share each

    # a later compile for the board applies the records: no trials, no board needed
    out = tmp_path / "art"
    res = run_cli("compile", onnx_path, "--target", "rpi4", "--tune", "--db", db, "--out", out)
    assert res.code == 0, res.err
    info = json.loads((out / "manifest.json").read_text())["tuning"]
    assert info["reused"] is True and info["trials_run"] == 0 and info["db_id"].startswith(path.parent.name)
    assert (path / "database_tuning_record.json").read_text().splitlines() == records
    # (the tuned, pre-packed aarch64 artifact runs under qemu like any other: tests/compiler/test_emulate.py)


def test_board_tuning_errors_are_one_line(run_cli, tmp_path):
    onnx_path = zoo.save("digits-mlp", tmp_path / "digits.onnx")
    res = run_cli("tune", onnx_path, "--target", "rpi4", "--db", tmp_path / "db")
    assert res.code == 1 and res.error_line.startswith("error: cannot tune for this target here")
    assert "--rpc" in res.error_line
    res = run_cli("tune", onnx_path, "--target", "rpi4", "--rpc", "nonsense", "--db", tmp_path / "db")
    assert res.code == 1 and "is not HOST:PORT" in res.error_line
    res = run_cli("tune", onnx_path, "--target", "rpi4", "--rpc", f"127.0.0.1:{_free_port()}",
                  "--db", tmp_path / "db")
    assert res.code == 1 and "cannot reach the TVM RPC server" in res.error_line
    res = run_cli("compile", onnx_path, "--target", "x86_64", "--rpc", "127.0.0.1:9", "--out", tmp_path / "a")
    assert res.code == 1 and "add --tune" in res.error_line
