"""Board disk images (firmware/osimage), issue 25's main proof: `fractal image build-os` makes a GPT
disk image of a C-backend artifact with its training module for a qemu ``virt`` board (Debian
trixie rootfs from pinned packages, busybox init, the node and the boot supervisor, the
application in slot a of the data partition); `fractal image configure` points it at a signed
fleet and a Mosquitto (dynamic security, no anonymous access) started here; the image file is
made larger than built (a bigger card) and `fractal image try` boots it under qemu-system. The
board grows its data partition to the end of the disk, makes its keys and is pending in
`GET /api/enrollments`; accepted through the API, it joins the signed swarm, answers an Open
Inference Protocol request through the forwarded port with onnxruntime's result (1e-4) and
trains a round with an x86_64 `fractal node` on this host (same parameters on both). One booted
image per board is shared by the tests (session fixture); SIGTERM to `try` stops the machine."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from compiler.manifest import file_sha256
from federation.broker import free_port
from tests.firmware.conftest import CLI, REPO, assert_refused, cli
from tests.fixtures_enrolment import SignedFleet, signed_fleet, start_dynsec_broker, wait_for
from tests.fixtures_node import DIGITS_BATCH, DIGITS_LR, write_node_toml
from tests.fixtures_osimage import image_try, stop_try

# build + boot under TCG runs in the fixture setup, which pytest-timeout counts against the first test
pytestmark = [pytest.mark.slow, pytest.mark.mosquitto, pytest.mark.timeout(2400)]

PRESET = {"aarch64-virt": "aarch64-c", "riscv64-virt": "riscv64"}
BOOT_TIMEOUT_S = 1500  # build + boot under TCG on a loaded 2-core machine
HOST_NODE = "host-1"  # the x86_64 member on this host
CARD_EXTRA_MIB = 192  # the "card" is this much larger than the image
# Over the air on a booted board: one board, aarch64-virt (it boots to ready in about 130 s under
# TCG, riscv64-virt in about 400 s: BENCHMARKS.md), so the three roll-outs add the least time.
OTA_BOARD = "aarch64-virt"
OTA_TIMEOUT_S = 1800  # a roll-out stage: install, reboot, node start and health check under TCG


@dataclass
class Booted:
    board: str
    image: Path
    artifact: Path
    url: str
    proc: subprocess.Popen[str]
    console: Path
    checks: dict[str, object]  # what the fresh image looked like before the board wrote to it
    node_id: str
    pending: dict  # its row in GET /api/enrollments while it waited for the operator
    built_size: int  # bytes of the image as built; the file is CARD_EXTRA_MIB larger at boot


@dataclass
class OsFleet:
    fleet: SignedFleet
    host_url: str  # the x86_64 member's HTTP API


@pytest.fixture(scope="session")
def os_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from firmware.keys import keygen

    return keygen(tmp_path_factory.mktemp("os-keys") / "release")[0]


@pytest.fixture(scope="session")
def c_artifacts(tmp_path_factory: pytest.TempPathFactory, digits_onnx: Path) -> dict[str, Path]:
    """digits-mlp compiled for each board's C preset (the route with no TVM on the board), with the
    training module the host's ``digits_artifact`` has (ce, sgd): the boards train with the C
    backend's training library."""
    from compiler import TrainSettings, compile_model

    d = tmp_path_factory.mktemp("os-artifacts")
    train = TrainSettings(loss="ce", optimizer="sgd", lr=DIGITS_LR, batch=DIGITS_BATCH)
    return {
        board: compile_model(digits_onnx, target=preset, out_dir=d / preset, train=train, progress=False)
        for board, preset in PRESET.items()
    }


@pytest.fixture(scope="session")
def os_fleet(
    tmp_path_factory: pytest.TempPathFactory,
    digits_artifact: Path,
    digits_data: tuple[np.ndarray, np.ndarray],
    os_keys: Path,
) -> Iterator[OsFleet]:
    """A signed fleet on a dynamic-security Mosquitto (the boards reach both as the host, 10.0.2.2)
    and its x86_64 member: `fractal node` on this host with half of the digits samples. Its image
    catalogue takes images signed with the boards' release key (over-the-air roll-outs)."""
    d = tmp_path_factory.mktemp("os-fleet")
    broker = start_dynsec_broker(d / "mosquitto")
    proc = None
    try:
        with signed_fleet(
            d,
            broker,
            f"os{os.getpid()}",
            [HOST_NODE],
            device_broker=f"mqtt://10.0.2.2:{broker.port}",
            image_keys=[f"{os_keys}.pub"],
            public_host="10.0.2.2",
            rollout_stage_timeout_s=OTA_TIMEOUT_S,
        ) as fleet:
            port = free_port()
            cfg = write_node_toml(
                d / HOST_NODE / "NODE.toml",
                {
                    "node_id": HOST_NODE,
                    "artifact": str(digits_artifact),
                    "port": port,
                    "data_dir": str(d / HOST_NODE / "data"),
                    "heartbeat_s": 1.0,
                    **fleet.member(HOST_NODE),
                },
            )
            with open(d / "host-node.log", "w") as log:
                proc = subprocess.Popen(
                    [*CLI, "node", "--config", str(cfg)],
                    cwd=REPO,
                    env={**os.environ, "PYTHONPATH": str(REPO)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _live(url), 120, "the host node's HTTP API", poll_s=0.5)
            x, y = digits_data
            _post(f"{url}/v1/samples", {"inputs": {"x": x[0:400:2].tolist()}, "labels": y[0:400:2].tolist()})
            yield OsFleet(fleet, url)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        broker.close()


def _live(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/live", timeout=5) as r:
            return int(r.status) == 200
    except OSError:
        return False


@pytest.fixture(scope="session", params=list(PRESET))
def booted(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    os_keys: Path,
    c_artifacts: dict[str, Path],
    os_fleet: OsFleet,
) -> Iterator[Booted]:
    board = request.param
    fleet = os_fleet.fleet
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
    # first-boot settings: the fleet and its broker, reached from inside as the host (10.0.2.2)
    token = fleet.client.post("/api/enrollment-tokens", json={"ttl_s": 3600, "uses": 1}).json()["token"]
    node_id = f"{board}-1"
    r = cli(
        "image",
        "configure",
        img,
        "--broker",
        f"mqtt://10.0.2.2:{fleet.broker.port}",
        "--fleet",
        f"http://10.0.2.2:{fleet.url.rsplit(':', 1)[1]}",
        "--swarm",
        fleet.swarm,
        "--enroll-token",
        token,
        "--hostname",
        node_id,
    )
    assert r.returncode == 0, r.stderr
    # written to a larger card: the board's first boot grows the data partition to its end
    built_size = img.stat().st_size
    os.truncate(img, built_size + CARD_EXTRA_MIB * 1024 * 1024)
    console = d / "console.log"
    proc, lines = image_try(img, console)
    try:
        # the node waits for the operator before it serves: pending first, accepted, then ready
        def pending() -> dict | None:
            assert proc.poll() is None, f"`image try` exited {proc.returncode}"
            return fleet.enrollment(node_id, "pending")

        row = wait_for(pending, BOOT_TIMEOUT_S, f"{node_id}'s enrolment request", poll_s=1.0)
        accepted = fleet.client.post(f"/api/enrollments/{node_id}/accept").json()
        assert accepted["state"] == "accepted", accepted
        line = lines.get(timeout=BOOT_TIMEOUT_S)
        assert line.startswith("node: "), f"`image try` printed {line!r}"
    except (AssertionError, queue.Empty) as exc:
        stop_try(proc)  # its machine too
        pytest.fail(f"{board}: {exc!r}; console:\n{console.read_text()[-4000:]}")
    url = line.split()[1]
    b = Booted(board, img, c_artifacts[board], url, proc, console, checks, node_id, row, built_size)
    yield b
    # SIGTERM stops the machine: `try` exits 0 and no qemu is left in its session (the machine the
    # test runs now: a power cut in the over-the-air tests starts another `try`)
    proc = b.proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)



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
        "sha256": file_sha256(img),
        "sha256_ok": sha_line == [file_sha256(img), img.name],
        "bmap_copy_rc": r.returncode,
        "bmap_stderr": r.stderr[-500:],
        "copy_sha256": file_sha256(card) if card.exists() else None,
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


def test_board_enrols_and_joins_the_signed_swarm(booted: Booted, os_fleet: OsFleet) -> None:
    """The device made its own keys and asked to join (pending: device id, arch, board, key
    fingerprint); accepted, its signed status is on the fleet under the configured swarm, with
    the configured hostname as node id, and its keyring holds the host member."""
    fleet = os_fleet.fleet
    arch = booted.board.split("-")[0]
    row = booted.pending
    assert (row["device_id"], row["arch"], row["board"]) == (booted.node_id, arch, PRESET[booted.board]), row
    assert row["key_fingerprint"].startswith("SHA256:") and row["key_id"], row
    node = wait_for(
        lambda: (n := fleet.node(booted.node_id)) and n["online"] and n, 300, "the board's signed status", 1.0
    )
    assert node["arch"] == arch, node
    assert fleet.client.get("/api/nodes").json()["rejected"].get("unknown_key", 0) == 0
    assert fleet.enrollment(booted.node_id, "accepted") is not None
    with urllib.request.urlopen(f"{booted.url}/v1/node", timeout=60) as r:
        mine = json.loads(r.read())
    assert (mine["node_id"], mine["swarm"], mine["broker"]) == (booted.node_id, fleet.swarm, True), mine


def test_board_trains_a_round_with_a_host_node(
    booted: Booted, os_fleet: OsFleet, digits_data: tuple[np.ndarray, np.ndarray]
) -> None:
    """A round started through the fleet API: the board (C-backend training library under
    emulation) and the x86_64 `fractal node` on this host end with the same parameters."""
    fleet = os_fleet.fleet
    # what the board trains with: the artifact's training library for the C runtime (no TVM)
    libs = json.loads((booted.artifact / "manifest.json").read_text())["libs"]
    assert (libs["runtime"], libs["train"], libs["train_runner"]) == (
        "c",
        "train-libmodel.so",
        "train-fractal-run",
    )
    x, y = digits_data
    _post(f"{booted.url}/v1/samples", {"inputs": {"x": x[1:400:2].tolist()}, "labels": y[1:400:2].tolist()})
    members = [HOST_NODE, booted.node_id]
    wait_for(
        lambda: all((n := fleet.node(m)) and n["online"] and n["samples"] >= 200 for m in members),
        300,
        "both members online with their samples",
        1.0,
    )
    before = {m: fleet.node(m)["params_sha256"] for m in members}  # type: ignore[index]
    r = fleet.client.post(
        "/api/rounds", json={"steps": 3, "lr": DIGITS_LR, "nodes": members, "step_timeout_s": 120}
    )
    assert r.status_code < 300, r.text
    rid = r.json()["round_id"]
    rnd = wait_for(
        lambda: (g := fleet.client.get(f"/api/rounds/{rid}").json())["state"] != "running" and g,
        900,
        "the round to end",
        1.0,
    )
    assert rnd["state"] == "done", rnd
    assert set(rnd["nodes"]) == set(members), rnd["nodes"]
    assert all(s["done"] and not s["failed"] for s in rnd["nodes"].values()), rnd["nodes"]
    assert rnd["params_agree"] is True and len({s["params_sha256"] for s in rnd["nodes"].values()}) == 1, rnd
    assert rnd["params_sha256"] not in before.values(), (before, rnd["params_sha256"])  # it trained
    # both members now serve the round's parameters (their statuses say which)
    wait_for(
        lambda: {fleet.node(m)["params_sha256"] for m in members} == {rnd["params_sha256"]},  # type: ignore[index]
        120,
        "both members' statuses to show the round's parameters",
        1.0,
    )


def test_data_partition_grew_to_fill_the_card(booted: Booted) -> None:
    """The image file was made CARD_EXTRA_MIB larger before the first boot (a larger card): the
    board moved GPT's backup header to the disk's end, grew the data partition (the last) to it
    and grew its ext4 filesystem online (its console, and the image's partition table)."""
    import re

    from firmware.osimage.disk import read_gpt

    console = booted.console.read_text()
    m = re.search(r"growdata: \S+ sectors (\d+)\+(\d+) of \S+ \((\d+) sectors\)", console)
    assert m, console[-3000:]
    start, size, total = map(int, m.groups())
    disk = booted.image.stat().st_size
    assert total * 512 == disk == booted.built_size + CARD_EXTRA_MIB * 1024 * 1024
    # GPT's backup (33 sectors) at the end; the partition ends within the 1 MiB alignment before it
    assert total - 33 - 2048 < start + size <= total - 33, (start, size, total)
    fs = re.search(r"growdata: the filesystem on \S+ is now (\d+) \((\d+)k\) blocks long", console)
    assert fs, console[-3000:]
    fs_bytes = int(fs.group(1)) * int(fs.group(2)) * 1024
    assert size * 512 - 4 * 1024 * 1024 <= fs_bytes <= size * 512, (fs_bytes, size)
    # the partition table the board wrote (primary GPT and its backup at the last sector)
    data = read_gpt(booted.image)["data"]
    assert (data.start, data.size) == (start * 512, size * 512), data
    with open(booted.image, "rb") as fh:
        fh.seek(disk - 512)
        assert fh.read(8) == b"EFI PART"


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


# -- over the air on the booted board (one board: OTA_BOARD) ------------------------------------
# The three roll-outs run in order on the same booted machine (each starts from where the last
# ended): 1.1.0 into slot b with a real reboot, a 1.2.0 that fails its health check (slot a, rolled
# back to b), then 1.3.0 with qemu SIGKILLed during the install and the machine powered on again.

_OTA: dict[str, float] = {}  # timings of the first roll-out, for the kill moment of the third


@dataclass
class OtaImages:
    entries: dict[str, dict]  # version -> its catalogue entry (id, size, version, board)


@pytest.fixture(scope="session")
def ota_images(
    tmp_path_factory: pytest.TempPathFactory,
    c_artifacts: dict[str, Path],
    os_keys: Path,
    os_fleet: OsFleet,
    digits_onnx: Path,
) -> OtaImages:
    """Newer application bundles of the board's artifact in the fleet's catalogue: 1.1.0 and 1.3.0
    by `fractal image build` (the OTA unit), 1.2.0 with a wrong expected output (fails its check)."""
    from compiler.verify import onnxruntime_reference
    from firmware.image import build_image

    d = tmp_path_factory.mktemp("ota-images")
    art = c_artifacts[OTA_BOARD]
    out: dict[str, dict] = {}
    for version in ("1.1.0", "1.3.0"):
        r = cli(
            "image", "build", art, "--board", PRESET[OTA_BOARD], "--key", os_keys, "--version", version,
            "--out", d / f"{version}.fimg",
        )
        assert r.returncode == 0, r.stderr
    x = {"x": np.random.default_rng(3).random((1, 64)).astype(np.float32)}
    wrong = {k: v + 1.0 for k, v in onnxruntime_reference(digits_onnx, x, 1).items()}
    build_image(art, board=PRESET[OTA_BOARD], key=os_keys, out=d / "1.2.0.fimg", version="1.2.0",
                reference=(x, wrong))
    for version in ("1.1.0", "1.2.0", "1.3.0"):
        r = os_fleet.fleet.client.post("/api/images", content=(d / f"{version}.fimg").read_bytes())
        assert r.status_code < 300, r.text
        out[version] = r.json()
    return OtaImages(out)


def _board_image(fleet: SignedFleet, node_id: str) -> dict | None:
    n = fleet.node(node_id)
    return n["image"] if n and n["online"] and n.get("image") else None


def _settled(fleet: SignedFleet, node_id: str) -> dict | None:
    """The board's image once this boot's health check passed (and it is not training)."""
    n = fleet.node(node_id)
    img = n["image"] if n and n["online"] and n["state"] == "online" else None
    return img if img and img["health"] == "passed" else None


def _rollout(fleet: SignedFleet, rid: str) -> dict:
    return dict(fleet.client.get(f"/api/rollouts/{rid}").json())


def _start_rollout(fleet: SignedFleet, image: dict, node_id: str) -> str:
    r = fleet.client.post("/api/rollouts", json={"image": image["id"], "nodes": [node_id]})
    assert r.status_code == 202, r.text
    return str(r.json()["rollout_id"])


def _ended(fleet: SignedFleet, rid: str, booted: Booted) -> dict:
    def ended() -> dict | None:
        assert booted.proc.poll() is None, f"`image try` exited {booted.proc.returncode}"
        ro = _rollout(fleet, rid)
        return ro if ro["state"] != "running" else None

    return dict(wait_for(ended, OTA_TIMEOUT_S, f"roll-out {rid} to end", 1.0))


def _phase(fleet: SignedFleet, rid: str, node_id: str) -> str:
    return str(_rollout(fleet, rid)["nodes"][node_id]["phase"])


def _boots(console: Path) -> int:
    """Kernel boots so far on this console (rcS prints its line once per boot)."""
    return console.read_text(errors="replace").count("rcS: up at")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as r:
            return int(r.status) == 200
    except OSError:
        return False


_PROBE = np.random.default_rng(11).random((2, 64)).astype(np.float32)


def _logits(url: str, version: str | None = None) -> np.ndarray:
    """The node's logits for a fixed probe: its current parameters, or ``version`` ("0": the
    parameters its image shipped)."""
    route = f"versions/{version}/infer" if version is not None else "infer"
    reply = _post(
        f"{url}/v2/models/digits-mlp/{route}",
        {"inputs": [{"name": "x", "shape": [2, 64], "datatype": "FP32", "data": _PROBE.ravel().tolist()}]},
    )
    out = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in reply["outputs"]}
    return out["logits"]


def _infers_like_onnxruntime(url: str, digits_onnx: Path) -> float:
    """How far the image's own parameters (version 0: the board may have trained since) answer
    from onnxruntime on the model."""
    from compiler.verify import onnxruntime_reference

    want = onnxruntime_reference(digits_onnx, {"x": _PROBE}, 1)["logits"]
    return float(np.abs(_logits(url, "0") - want).max())


def _console_tail(booted: Booted) -> str:
    return booted.console.read_text(errors="replace")[-4000:]


def _console_with(booted: Booted, line: str, timeout: float = 600) -> str:
    """The console once it holds ``line`` (waited for as long as the machine runs). The board's
    supervisor logs a health check's outcome after it wrote the boot state the node reports from:
    the fleet can see a slot good before the console says so."""
    deadline = time.monotonic() + timeout
    while line not in (console := booted.console.read_text(errors="replace")):
        assert booted.proc.poll() is None and time.monotonic() < deadline, f"no {line!r} on the console"
        time.sleep(1)
    return console


@pytest.mark.parametrize("booted", [OTA_BOARD], indirect=True)
def test_ota_rollout_reboots_the_board_into_the_new_slot(
    booted: Booted, os_fleet: OsFleet, ota_images: OtaImages, digits_onnx: Path
) -> None:
    """A roll-out of 1.1.0 from the fleet API: the board downloads it, flashes slot b of its data
    partition, reports `rebooting` and reboots the machine (its service, on the node's reboot
    code; qemu resets it: a second kernel boot on the same console); slot b passes its health
    check and the roll-out is `done` from the board's signed status."""
    fleet, node = os_fleet.fleet, booted.node_id
    try:
        img = wait_for(lambda: _settled(fleet, node), 600, f"{node} settled", 1.0)
        assert (img["version"], img["slot"]) == ("1.0.0", "a"), img
        learned = _logits(booted.url)  # what the board answers now (after its training round, if any)
        boots = _boots(booted.console)
        t0 = time.monotonic()
        rid = _start_rollout(fleet, ota_images.entries["1.1.0"], node)
        wait_for(lambda: _phase(fleet, rid, node) != "sent", 300, "the board to start the install", 0.2)
        t_dl = time.monotonic()
        wait_for(
            lambda: _phase(fleet, rid, node) not in ("sent", "downloading"), 900, "the install to end", 0.2
        )
        t_reb = time.monotonic()
        assert _phase(fleet, rid, node) == "rebooting", _rollout(fleet, rid)
        wait_for(lambda: _boots(booted.console) > boots, 900, "the board to boot again", 0.5)
        t_up = time.monotonic()
        wait_for(lambda: _ready(booted.url), 900, "the node of the new slot", 0.5)
        t_ready = time.monotonic()
        ro = _ended(fleet, rid, booted)
        t_done = time.monotonic()
        assert ro["state"] == "done", ro
        img = wait_for(
            lambda: (i := _settled(fleet, node)) and i["version"] == "1.1.0" and i, 60, "1.1.0 settled", 1.0
        )
        assert (img["slot"], img["state"], img["previous"], img["update"]["phase"]) == (
            "b", "good", "1.0.0", "done"
        ), img
        console = _console_with(booted, "slot b (version 1.1.0) passed its health check: marked good")
        assert "the node asked for a reboot; rebooting the board" in console
        assert _boots(booted.console) == boots + 1  # one real reboot
        assert booted.proc.poll() is None  # `try` kept the machine: qemu reset it
        assert _infers_like_onnxruntime(booted.url, digits_onnx) <= 1e-4
        # the update replaced the application, not what the board learned (data partition)
        np.testing.assert_allclose(_logits(booted.url), learned, atol=1e-5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nconsole:\n{_console_tail(booted)}") from None
    _OTA.update(command_to_install=t_dl - t0, install=t_reb - t_dl, reboot_to_kernel=t_up - t_reb,
                reboot_to_ready=t_ready - t_reb, reboot_to_done=t_done - t_reb)
    print("OTA on the booted board: " + ", ".join(f"{k} {v:.1f} s" for k, v in _OTA.items()))


@pytest.mark.parametrize("booted", [OTA_BOARD], indirect=True)
def test_ota_rollout_failing_its_health_check_rolls_back(
    booted: Booted, os_fleet: OsFleet, ota_images: OtaImages
) -> None:
    """1.2.0 (wrong expected output) is flashed into slot a and booted after a reboot; it fails its
    health check, the board marks it bad and boots slot b (1.1.0) again by itself; the roll-out
    fails with the board's reason."""
    fleet, node = os_fleet.fleet, booted.node_id
    try:
        img = wait_for(lambda: _settled(fleet, node), 600, f"{node} settled", 1.0)
        assert (img["version"], img["slot"]) == ("1.1.0", "b"), img
        rid = _start_rollout(fleet, ota_images.entries["1.2.0"], node)
        ro = _ended(fleet, rid, booted)
        assert ro["state"] == "failed", ro
        assert "rolled back by itself" in ro["reason"] and "expected output" in ro["reason"], ro["reason"]
        img = wait_for(lambda: _settled(fleet, node), 600, f"{node} settled", 1.0)
        assert (img["version"], img["slot"], img["state"], img["update"]["phase"]) == (
            "1.1.0", "b", "good", "rolled_back"
        ), img
        console = booted.console.read_text(errors="replace")
        assert "slot a failed its health check" in console and "falling back to slot b" in console
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nconsole:\n{_console_tail(booted)}") from None


def _qemu_pid(proc: subprocess.Popen[str]) -> int:
    """The qemu-system process `image try` runs (its child)."""
    for task in Path(f"/proc/{proc.pid}/task").iterdir():
        for kid in (task / "children").read_text().split():
            if Path(f"/proc/{kid}/comm").read_text().startswith("qemu-system"):
                return int(kid)
    raise AssertionError(f"`image try` ({proc.pid}) runs no qemu-system")


@pytest.mark.parametrize("booted", [OTA_BOARD], indirect=True)
def test_ota_power_cut_during_an_install_boots_a_verified_slot(
    booted: Booted, os_fleet: OsFleet, ota_images: OtaImages, digits_onnx: Path
) -> None:
    """qemu SIGKILLed (a power cut: the guest's page cache is lost) at a random moment of the
    1.3.0 install (seed printed; FRACTAL_OTA_KILL_SEED replays it), then `image try` again: the
    board boots a slot that verifies and passes its check (1.1.0, or 1.3.0 only when its install
    had completed) and serves inference; the roll-out ends (done on 1.3.0, failed otherwise)."""
    import random

    fleet, node = os_fleet.fleet, booted.node_id
    seed = int(os.environ.get("FRACTAL_OTA_KILL_SEED") or time.time_ns() % 2**32)
    window = _OTA.get("install", 20.0)  # as long as the first install took
    delay = random.Random(seed).uniform(0.0, window)
    record = booted.console.with_name("ota-kill.txt")
    try:
        img = wait_for(lambda: _settled(fleet, node), 600, f"{node} settled", 1.0)
        assert (img["version"], img["slot"]) == ("1.1.0", "b"), img
        rid = _start_rollout(fleet, ota_images.entries["1.3.0"], node)
        wait_for(lambda: _phase(fleet, rid, node) != "sent", 300, "the board to start the install", 0.2)
        time.sleep(delay)  # the random moment: a power cut does not wait for events
        seen = _phase(fleet, rid, node)
        os.kill(_qemu_pid(booted.proc), signal.SIGKILL)
        booted.proc.wait(60)
        what = (f"seed {seed}: qemu SIGKILLed {delay:.2f} s into the install (window {window:.1f} s), "
                f"the fleet had seen phase {seen!r}")
        record.write_text(what + "\n")
        print(f"OTA power cut: {what}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nconsole:\n{_console_tail(booted)}") from None
    # power on again
    console = booted.console.with_name("console-after-power-cut.log")
    proc, lines = image_try(booted.image, console)
    booted.proc, booted.console = proc, console  # the fixture's teardown stops this machine
    t0 = time.monotonic()
    try:
        line = lines.get(timeout=BOOT_TIMEOUT_S)
        assert line.startswith("node: "), f"`image try` printed {line!r}"
        booted.url = line.split()[1]
        t_ready = time.monotonic()
        img = wait_for(lambda: _settled(fleet, node), 600, f"{node} settled", 1.0)
        assert img["state"] == "good", img
        assert (img["version"], img["slot"]) in (("1.1.0", "b"), ("1.3.0", "a")), img
        assert _infers_like_onnxruntime(booted.url, digits_onnx) <= 1e-4
        ro = _ended(fleet, rid, booted)
        if img["version"] == "1.3.0":  # the install had completed: its trial boot passed
            assert ro["state"] == "done" and img["update"]["phase"] == "done", (ro, img)
        else:  # cut before the switch (or the new slot did not verify): the old slot, roll-out failed
            assert ro["state"] == "failed", ro
            assert "interrupted" in ro["reason"] or "rolled back" in ro["reason"], ro["reason"]
        print(f"OTA power cut: powered on again, ready in {t_ready - t0:.1f} s, on {img['version']} "
              f"(slot {img['slot']}); roll-out {ro['state']}: {ro['reason']}")
    except (AssertionError, queue.Empty) as exc:
        raise AssertionError(f"{what}: {exc!r}\nconsole:\n{_console_tail(booted)}") from None
