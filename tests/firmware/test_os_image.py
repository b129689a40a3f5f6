"""Board disk images (firmware/osimage): `fractal image build-os` makes a GPT disk image of a
C-backend artifact for a qemu ``virt`` board (Debian trixie rootfs from pinned packages, busybox
init, the node and the boot supervisor, the application in slot a of the data partition), and
`fractal image try` boots it under qemu-system: the node inside answers an Open Inference
Protocol request through the forwarded port with onnxruntime's result (1e-4). One booted image
per board is shared by the tests (session fixture); SIGTERM to `try` stops the machine."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from federation.broker import MosquittoBroker
from tests.edgenode.test_cli_node import free_port
from tests.firmware.conftest import CLI, REPO, assert_refused, cli

# build + boot under TCG runs in the fixture setup, which pytest-timeout counts against the first test
pytestmark = [pytest.mark.slow, pytest.mark.mosquitto, pytest.mark.timeout(2400)]

PRESET = {"aarch64-virt": "aarch64-c", "riscv64-virt": "riscv64"}
BOOT_TIMEOUT_S = 1500  # build + boot under TCG on a loaded 2-core machine


@dataclass
class Booted:
    board: str
    image: Path
    artifact: Path
    url: str
    proc: subprocess.Popen[str]
    console: Path
    checks: dict[str, object]
    swarm: str  # what the fresh image looked like before the board wrote to it


@pytest.fixture(scope="session")
def os_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from firmware.keys import keygen

    return keygen(tmp_path_factory.mktemp("os-keys") / "release")[0]


@pytest.fixture(scope="session")
def c_artifacts(tmp_path_factory: pytest.TempPathFactory, digits_onnx: Path) -> dict[str, Path]:
    """digits-mlp compiled for each board's C preset (the route with no TVM on the board)."""
    from compiler import compile_model

    d = tmp_path_factory.mktemp("os-artifacts")
    return {
        board: compile_model(digits_onnx, target=preset, out_dir=d / preset, progress=False)
        for board, preset in PRESET.items()
    }


@pytest.fixture(scope="session", params=list(PRESET))
def booted(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    os_keys: Path,
    c_artifacts: dict[str, Path],
    mosquitto: MosquittoBroker,
) -> Iterator[Booted]:
    board = request.param
    d = tmp_path_factory.mktemp(f"os-{board}")
    img = d / f"{board}.img"
    r = cli(
        "image",
        "build-os",
        c_artifacts[board],
        "--board",
        board,
        "--key",
        os_keys,
        "--version",
        "1.0.0",
        "--out",
        img,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    checks = _fresh_image_checks(img, d)
    # first-boot settings: the session's Mosquitto, reached from inside as the host (10.0.2.2)
    swarm = f"os{os.getpid()}-{board}"
    r = cli(
        "image",
        "configure",
        img,
        "--broker",
        f"mqtt://10.0.2.2:{mosquitto.port}",
        "--fleet",
        "http://10.0.2.2:9",
        "--swarm",
        swarm,
        "--enroll-token",
        "enrol-token-1",
        "--hostname",
        f"{board}-1",
    )
    assert r.returncode == 0, r.stderr
    console = d / "console.log"
    with open(console, "w") as log:
        proc = subprocess.Popen(
            [*CLI, "image", "try", str(img), "--port", str(free_port())],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or []], daemon=True).start()
    try:
        line = lines.get(timeout=BOOT_TIMEOUT_S)
    except queue.Empty:
        line = ""
    if not line.startswith("node: "):
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"`image try` printed {line!r}; console:\n{console.read_text()[-4000:]}")
    yield Booted(board, img, c_artifacts[board], line.split()[1], proc, console, checks, swarm)
    # SIGTERM stops the machine: `try` exits 0 and no qemu is left in its session
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fresh_image_checks(img: Path, d: Path) -> dict[str, object]:
    from firmware.osimage.disk import fat_list, read_gpt

    parts = read_gpt(img)
    sha_line = img.with_name(img.name + ".sha256").read_text().split()
    bmap_path = img.with_name(img.name + ".bmap")
    bmap = ET.parse(bmap_path).getroot()
    card = d / "card.img"
    r = subprocess.run(
        ["bmaptool", "copy", "--bmap", str(bmap_path), str(img), str(card)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out: dict[str, object] = {
        "partitions": list(parts),
        "sha256": _sha256(img),
        "sha256_ok": sha_line == [_sha256(img), img.name],
        "bmap_copy_rc": r.returncode,
        "bmap_stderr": r.stderr[-500:],
        "copy_sha256": _sha256(card) if card.exists() else None,
        "size": img.stat().st_size,
        "mapped": int(bmap.findtext("MappedBlocksCount") or 0) * int(bmap.findtext("BlockSize") or 0),
        "boot_files": set(fat_list(img, parts["boot"])),
    }
    card.unlink(missing_ok=True)
    return out


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_booted_board_serves_inference_matching_onnxruntime(booted: Booted, digits_onnx: Path) -> None:
    from compiler.verify import onnxruntime_reference

    with urllib.request.urlopen(f"{booted.url}/v1/node", timeout=60) as r:
        node = json.loads(r.read())
    assert node["arch"] == booted.board.split("-")[0], node
    x = np.random.default_rng(7).random((1, 64)).astype(np.float32)
    reply = _post(
        f"{booted.url}/v2/models/digits-mlp/infer",
        {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": x.ravel().tolist()}]},
    )
    out = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in reply["outputs"]}
    ref = onnxruntime_reference(digits_onnx, {"x": x}, 1)
    assert np.abs(out["logits"] - ref["logits"]).max() <= 1e-4
    # the first boot was the slot's trial: its health check on the board marked it good (the check
    # runs its reference inference after the node is ready, so under TCG it may log after `try`
    # saw ready: wait for the line, as long as the machine runs)
    deadline = time.monotonic() + 600
    console = booted.console.read_text()
    while "passed its health check: marked good" not in console:
        assert booted.proc.poll() is None and time.monotonic() < deadline, console[-3000:]
        time.sleep(1)
        console = booted.console.read_text()


def test_image_layout_bmap_and_sha256(booted: Booted) -> None:
    """GPT with boot/root/data; the .sha256 matches the image as built; the .bmap maps only the
    written blocks and `bmaptool copy` (what a user runs to write a card) accepts it."""
    c = booted.checks
    assert c["partitions"] == ["boot", "root", "data"]
    assert c["sha256_ok"], c
    assert c["bmap_copy_rc"] == 0, c
    assert c["copy_sha256"] == c["sha256"], c  # the card holds the image, holes included
    assert 0 < int(c["mapped"]) < int(c["size"]) // 2, c  # mostly holes: only data is written
    assert c["boot_files"] >= {
        "vmlinuz" if booted.board == "aarch64-virt" else "vmlinux",
        "initrd.img",
        "cmdline.txt",
    }, c


def test_build_os_refuses_tvm_artifacts_and_unknown_boards(
    digits_artifact: Path, os_keys: Path, tmp_path: Path
) -> None:
    out = tmp_path / "x.img"
    r = cli(
        "image",
        "build-os",
        digits_artifact,
        "--board",
        "aarch64-virt",
        "--key",
        os_keys,
        "--version",
        "1.0.0",
        "--out",
        out,
    )
    assert_refused(r, "C-backend", "aarch64-c")
    r = cli(
        "image",
        "build-os",
        digits_artifact,
        "--board",
        "pdp11",
        "--key",
        os_keys,
        "--version",
        "1.0.0",
        "--out",
        out,
    )
    assert_refused(r, "unknown board 'pdp11'", "aarch64-virt")
    assert not out.exists()


def test_configured_board_joins_the_broker_as_its_hostname(
    booted: Booted, mosquitto: MosquittoBroker
) -> None:
    """`fractal image configure` settings, read at boot: the node's retained status is on the
    configured broker, under the configured swarm, with the configured hostname as node id."""
    from federation import topics
    from federation.messages import NodeState, parse_status
    from federation.mqtt import MqttLink

    got: queue.Queue = queue.Queue()
    link = MqttLink(mosquitto.url, client_id=f"watch-{booted.swarm}", swarm=booted.swarm)
    try:
        link.subscribe(
            topics.status(booted.swarm, f"{booted.board}-1"), lambda _t, p: got.put(parse_status(p))
        )
        status = got.get(timeout=60)  # retained: there as soon as the subscription is
    finally:
        link.close()
    assert status.node_id == f"{booted.board}-1" and status.state == NodeState.ONLINE, status
    with urllib.request.urlopen(f"{booted.url}/v1/node", timeout=60) as r:
        node = json.loads(r.read())
    assert (node["node_id"], node["swarm"], node["broker"]) == (f"{booted.board}-1", booted.swarm, True), node


def test_configure_refuses_bad_settings(tmp_path: Path) -> None:
    img = tmp_path / "none.img"
    r = cli(
        "image",
        "configure",
        img,
        "--broker",
        "http://x",
        "--fleet",
        "http://f",
        "--swarm",
        "s",
        "--enroll-token",
        "abcdefgh1",
    )
    assert_refused(r, "broker 'http://x'", "mqtt://")
    r = cli(
        "image",
        "configure",
        img,
        "--broker",
        "mqtt://h:1883",
        "--fleet",
        "http://f",
        "--swarm",
        "a/b",
        "--enroll-token",
        "abcdefgh1",
    )
    assert_refused(r, "swarm 'a/b'")
    r = cli(
        "image",
        "configure",
        img,
        "--broker",
        "mqtt://h:1883",
        "--fleet",
        "http://f",
        "--swarm",
        "s",
        "--enroll-token",
        "abcdefgh1",
    )
    assert_refused(r, "no such image file")
