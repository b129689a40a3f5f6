"""riscv64 device images of a C-backend artifact: the image carries the native model library and
the runner (inference and training, as the artifact's manifest lists them), its health reference
comes from the runner under qemu-riscv64, it refuses an artifact that lacks or damages one of
them, and a flashed riscv64 image boots under qemu-riscv64 and passes its health check."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.edgenode.test_cli_node import free_port
from tests.firmware.conftest import assert_refused, cli

pytestmark = [pytest.mark.emulate]

BOARD = "riscv64-rvv"


@pytest.fixture(scope="module")
def digits_rv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits-mlp compiled with its training module for riscv64-rvv by the CLI (the C route)."""
    from compiler import zoo

    d = tmp_path_factory.mktemp("fw-rv")
    zoo.save("digits-mlp", d / "digits-mlp.onnx")
    out = d / "digits-mlp-rv"
    r = cli("compile", d / "digits-mlp.onnx", "--target", BOARD, "--out", out, "--train", "--loss", "ce",
            "--optimizer", "sgd", "--lr", "0.1", "--batch", "8", timeout=600)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def rv_image(tmp_path_factory: pytest.TempPathFactory, digits_rv: Path, fw_keys: dict[str, Path]) -> Path:
    img = tmp_path_factory.mktemp("fw-rv-img") / "rv.img"
    r = cli("image", "build", digits_rv, "--board", BOARD, "--key", fw_keys["k1"], "--out", img,
            "--version", "1.0.0", timeout=600)
    assert r.returncode == 0, r.stderr
    return img


def test_riscv64_image_carries_the_c_library_and_runner(rv_image: Path, digits_rv: Path,
                                                        fw_keys: dict[str, Path], tmp_path: Path) -> None:
    from compiler.emulate import EM_RISCV, elf_info
    from compiler.manifest import Manifest
    from compiler.verify import onnxruntime_reference

    man = Manifest.read(digits_rv)
    assert man.libs.runtime == "c"
    libs = {"infer": man.libs.infer, "train": man.libs.train, "runner": man.libs.runner,
            "train_runner": man.libs.train_runner}
    assert None not in libs.values(), libs
    r = cli("image", "verify", rv_image, "--pubkey", f"{fw_keys['k1']}.pub")
    assert r.returncode == 0 and r.stdout.startswith("ok:"), r.stderr
    r = cli("image", "info", rv_image)  # the human listing names every member
    assert r.returncode == 0, r.stderr
    for f in libs.values():
        assert f"member artifact/{f} " in r.stdout, r.stdout
    m = json.loads(cli("image", "info", rv_image, "--json").stdout)
    members = {e["name"]: e for e in m["members"]}
    for f in libs.values():
        assert members[f"artifact/{f}"]["sha256"] == man.files[f]  # the compiled bytes, unchanged
    assert {"health/input.npz", "health/expected.npz"} <= set(members)
    rt = m["runtime"]
    assert (rt["arch"], rt["kind"]) == ("riscv64", "c")
    assert rt["native"] == {role: f"artifact/{f}" for role, f in libs.items()}
    assert "tvm" not in " ".join(rt["packages"]).lower()  # no TVM on a riscv64 board
    # Flashed, the slot holds riscv64 ELF files, and the health reference (computed by the runner
    # under qemu-riscv64 at build time) agrees with onnxruntime.
    device = tmp_path / "board"
    r = cli("image", "flash", rv_image, "--device", device, "--pubkey", f"{fw_keys['k1']}.pub")
    assert r.returncode == 0, r.stderr
    art = device / "a" / "artifact"
    for role in ("infer", "train"):
        info = elf_info(art / libs[role])
        assert info.machine == EM_RISCV and info.bits == 64 and info.shared_object, (role, info)
    for role in ("runner", "train_runner"):  # programs: executable once flashed, and only they
        assert elf_info(art / libs[role]).machine == EM_RISCV
        assert members[f"artifact/{libs[role]}"].get("exec") is True
    assert sorted(p.name for p in art.iterdir() if os.access(p, os.X_OK)) == \
        sorted([libs["runner"], libs["train_runner"]])
    with np.load(device / "a" / "health" / "input.npz") as z:
        x = {k: z[k] for k in z.files}
    with np.load(device / "a" / "health" / "expected.npz") as z:
        expected = z["logits"]
    # ... and the flashed runner runs: the reference input through it under qemu-riscv64
    from compiler.artifact import load_params
    from compiler.emulate import run_c_runner

    _, params = load_params(art, man)
    got = run_c_runner(art / libs["runner"], "riscv64", "main", [*x.values(), *params])
    ref = onnxruntime_reference(digits_rv.parent / "digits-mlp.onnx", x, man.batch)
    assert np.abs(expected - ref["logits"]).max() <= 1e-4
    assert np.array_equal(got[0], expected)


def test_image_build_refuses_a_c_artifact_missing_or_damaging_its_runner(
        digits_rv: Path, fw_keys: dict[str, Path], tmp_path: Path) -> None:
    unlisted = tmp_path / "unlisted"
    shutil.copytree(digits_rv, unlisted)
    mj = json.loads((unlisted / "manifest.json").read_text())
    runner = mj["libs"]["runner"]
    del mj["files"][runner]  # the manifest names a runner it has no sha256 for
    (unlisted / "manifest.json").write_text(json.dumps(mj))
    out = tmp_path / "x.img"
    r = cli("image", "build", unlisted, "--board", BOARD, "--key", fw_keys["k1"], "--out", out,
            "--version", "1.0.0")
    assert_refused(r, runner, "no sha256")
    damaged = tmp_path / "damaged"
    shutil.copytree(digits_rv, damaged)
    with open(damaged / runner, "r+b") as fh:
        fh.seek(200)
        b = fh.read(1)
        fh.seek(200)
        fh.write(bytes([b[0] ^ 0xFF]))
    r = cli("image", "build", damaged, "--board", BOARD, "--key", fw_keys["k1"], "--out", out,
            "--version", "1.0.0")
    assert_refused(r, runner, "sha256")
    assert not out.exists()


@pytest.mark.slow
def test_riscv64_image_boots_under_qemu_and_passes_its_health_check(rv_image: Path,
                                                                     fw_keys: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """`fractal boot --emulate-riscv`: the node starts from the slot on riscv64 (trixie Python under
    qemu-riscv64, the model's C library through ctypes) and answers the image's reference input."""
    from compiler.emulate import sysroot_dir

    assert (sysroot_dir("riscv64") / ".done").is_file(), "run `make sysroot` (make test depends on it)"
    device = tmp_path / "board"
    r = cli("image", "flash", rv_image, "--device", device, "--pubkey", f"{fw_keys['k1']}.pub")
    assert r.returncode == 0, r.stderr
    r = cli("boot", "--device", device, "--port", str(free_port()), "--emulate-riscv", "--once",
            "--health-timeout", "400", timeout=500)
    node_log = device / "data" / "node-a.log"
    assert r.returncode == 0, r.stderr + (node_log.read_text()[-2000:] if node_log.is_file() else "")
    assert "booted slot a version 1.0.0" in r.stdout and "after fallback" not in r.stdout, r.stdout
    st = json.loads((device / "data" / "boot-state.json").read_text())
    assert st["slots"]["a"]["state"] == "good" and st["board"] == BOARD
    r = cli("boot", "--device", device, "--emulate-riscv", "--emulate-arm", "--once")
    assert_refused(r, "--emulate-arm and --emulate-riscv")
