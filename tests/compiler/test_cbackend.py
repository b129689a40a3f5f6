"""The C backend (compiler/cbackend.py + compiler/cruntime): x86_64 natively against the Relax VM
and onnxruntime, riscv64 / riscv64-rvv / aarch64 under qemu-user against onnxruntime, the RVV
build's vector instructions, the runner's .npy contract and its errors, and training via ctypes.

Artifacts are built once per session (lazily, per model and preset) and shared by the tests.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from compiler import zoo
from compiler.artifact import load_artifact
from compiler.cbackend import LIB_NAME, RUNNER_NAME, CLibrary, compile_c, generate_entry, lower
from compiler.emulate import run_c_runner, runner_command
from compiler.errors import EmulationError, InputError, ModelError
from compiler.manifest import Manifest
from compiler.targets import get_preset, host_preset_name
from compiler.trainbuild import TrainSettings
from compiler.verify import onnxruntime_reference, verify_artifact

MLPS = ["sensor-mlp", "digits-mlp"]
CNNS = [m for m in zoo.NAMES if m not in MLPS]
TOL = 1e-4


@pytest.fixture(scope="session")
def cb_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cbackend")


@pytest.fixture(scope="session")
def zoo_onnx(cb_dir: Path) -> Callable[[str], Path]:
    def get(name: str) -> Path:
        path = cb_dir / f"{name}.onnx"
        if not path.exists():
            zoo.save(name, path)
        return path
    return get


@pytest.fixture(scope="session")
def artifact(cb_dir: Path, zoo_onnx: Callable[[str], Path]) -> Callable[..., Path]:
    """``artifact(model, preset, train=None)``: compile_model output, built once per session."""
    from compiler import compile_model

    def get(name: str, preset: str, train: TrainSettings | None = None) -> Path:
        out = cb_dir / f"{name}-{preset}{'-train' if train else ''}"
        if not (out / "manifest.json").exists():
            compile_model(zoo_onnx(name), target=preset, out_dir=out, train=train, progress=False)
        return out
    return get


@pytest.fixture(scope="session")
def host_c(cb_dir: Path) -> Callable[[str], tuple[Path, list[np.ndarray]]]:
    """``host_c(model)``: (directory with the host-arch libmodel.so + fractal-run, params)."""
    from compiler.importer import import_model

    built: dict[str, tuple[Path, list[np.ndarray]]] = {}

    def get(name: str) -> tuple[Path, list[np.ndarray]]:
        if name not in built:
            imp = import_model(zoo.build(name))
            out = cb_dir / f"{name}-host-c"
            compile_c(imp.mod, get_preset(host_preset_name()), out, funcs=["main"], model_name=name)
            built[name] = (out, imp.params)
        return built[name]
    return get


def _x(name: str, n: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(zoo.input_shape(name, batch=n)).astype(np.float32)


def _check_host(name: str, host_c: Callable, zoo_onnx: Callable, artifact: Callable | None) -> None:
    out, params = host_c(name)
    lib = CLibrary(out / LIB_NAME)
    x = _x(name)
    got = lib.call("main", [x, *params])[0]
    ref = onnxruntime_reference(zoo_onnx(name), {"x": x}, 1)
    key = next(iter(ref))
    assert got.shape == ref[key].shape
    assert np.abs(got - ref[key]).max() <= TOL
    if artifact is not None:  # the Relax VM on the same machine, same inputs
        vm = load_artifact(artifact(name, host_preset_name())).infer({"x": x})[key]
        assert np.abs(got - vm).max() <= TOL


@pytest.mark.parametrize("name", MLPS)
def test_host_c_matches_relax_vm_and_onnxruntime(name: str, host_c: Callable, zoo_onnx: Callable,
                                                 artifact: Callable) -> None:
    _check_host(name, host_c, zoo_onnx, artifact)


@pytest.mark.slow
@pytest.mark.parametrize("name", CNNS)
def test_host_c_matches_onnxruntime_cnns(name: str, host_c: Callable, zoo_onnx: Callable) -> None:
    _check_host(name, host_c, zoo_onnx, None)


def test_runner_npy_contract_and_errors(host_c: Callable, tmp_path: Path) -> None:
    out, params = host_c("sensor-mlp")
    runner = out / RUNNER_NAME
    listing = subprocess.run([str(runner), "--list"], capture_output=True, text=True, check=True).stdout
    assert "main <f4(1, 16) <f4(16, 32)" in listing and "-> <f4(1, 3)" in listing
    x = _x("sensor-mlp")
    arch = get_preset(host_preset_name()).arch
    via_runner = run_c_runner(runner, arch, "main", [x, *params])[0]
    via_ctypes = CLibrary(out / LIB_NAME).call("main", [x, *params])[0]
    assert np.array_equal(via_runner, via_ctypes)
    # a wrong shape is refused with one error line naming the file, exit 1
    ind, outd = tmp_path / "in", tmp_path / "out"
    ind.mkdir()
    outd.mkdir()
    for i, a in enumerate([np.zeros((2, 16), np.float32), *params]):
        np.save(ind / f"{i}.npy", a)
    proc = subprocess.run([str(runner), "main", str(ind), str(outd)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: bad input") and "0.npy: shape differs" in proc.stderr
    np.save(ind / "0.npy", np.zeros((1, 16), np.float64))
    proc = subprocess.run([str(runner), "main", str(ind), str(outd)], capture_output=True, text=True)
    assert proc.returncode == 1 and "dtype is not <f4" in proc.stderr
    (ind / "0.npy").write_bytes(b"not numpy")
    proc = subprocess.run([str(runner), "main", str(ind), str(outd)], capture_output=True, text=True)
    assert proc.returncode == 1 and "is not a .npy file" in proc.stderr
    proc = subprocess.run([str(runner), "nope", str(ind), str(outd)], capture_output=True, text=True)
    assert proc.returncode == 1 and "no such function" in proc.stderr
    with pytest.raises(InputError, match="expected float32"):
        CLibrary(out / LIB_NAME).call("main", [x.astype(np.float64), *params])


def test_static_shapes_required() -> None:
    """A symbolic dimension (here beyond the batch) is refused while generating, with one line."""
    import tvm
    from tvm import relax
    from tvm.script import relax as R

    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, n), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(R.nn.relu(x))
        bb.emit_func_output(y)
    low = lower(bb.get(), get_preset(host_preset_name()).tvm_target())
    with pytest.raises(ModelError, match="static shapes.*symbolic dimension n"):
        generate_entry(low, ["main"], "dyn")


def _objdump_vector_ops(lib: Path) -> int:
    text = subprocess.run(["riscv64-linux-gnu-objdump", "-d", str(lib)], capture_output=True, text=True,
                          check=True).stdout
    ops = ("vle32.v", "vse32.v", "vfmacc.v", "vfmadd.v", "vfadd.v", "vfmul.v", "vfmax.v", "vsetvli")
    return sum(1 for ln in text.splitlines() if any(f"\t{op}" in ln for op in ops))


@pytest.mark.emulate
def test_rvv_build_has_vector_instructions(artifact: Callable) -> None:
    rvv = artifact("digits-mlp", "riscv64-rvv") / LIB_NAME
    plain = artifact("digits-mlp", "riscv64") / LIB_NAME
    assert _objdump_vector_ops(rvv) > 20
    assert _objdump_vector_ops(plain) == 0


@pytest.mark.emulate
@pytest.mark.parametrize("preset", ["riscv64", "riscv64-rvv"])
@pytest.mark.parametrize("name", MLPS)
def test_riscv_mlps_under_qemu(name: str, preset: str, artifact: Callable, zoo_onnx: Callable) -> None:
    res = verify_artifact(artifact(name, preset), zoo_onnx(name), emulate=True)
    assert res.ok and res.emulated, res


@pytest.mark.emulate
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["riscv64", "riscv64-rvv"])
@pytest.mark.parametrize("name", CNNS)
def test_riscv_cnns_under_qemu(name: str, preset: str, artifact: Callable, zoo_onnx: Callable) -> None:
    res = verify_artifact(artifact(name, preset), zoo_onnx(name), emulate=True, batches=1)
    assert res.ok and res.emulated, res


@pytest.mark.emulate
@pytest.mark.parametrize("name", ["digits-mlp", "resnet8-cifar10"])
def test_aarch64_c_backend_under_qemu(name: str, cb_dir: Path, zoo_onnx: Callable) -> None:
    """The same route builds for aarch64 (one more backend, not a RISC-V special case)."""
    from compiler.importer import import_model

    imp = import_model(zoo.build(name))
    out = cb_dir / f"{name}-aarch64-c"
    build, _ = compile_c(imp.mod, get_preset("aarch64"), out, funcs=["main"], model_name=name)
    assert runner_command(build.runner, "aarch64")[0] == "qemu-aarch64"
    x = _x(name)
    got = run_c_runner(build.runner, "aarch64", "main", [x, *imp.params])[0]
    ref = next(iter(onnxruntime_reference(zoo_onnx(name), {"x": x}, 1).values()))
    assert np.abs(got - ref).max() <= TOL


def test_native_build_is_cached(host_c: Callable, cb_dir: Path) -> None:
    from compiler.importer import import_model

    host_c("sensor-mlp")
    imp = import_model(zoo.build("sensor-mlp"))
    build, _ = compile_c(imp.mod, get_preset(host_preset_name()), cb_dir / "again", funcs=["main"],
                         model_name="sensor-mlp")
    assert build.cached


@pytest.mark.emulate
def test_riscv_verify_cli(run_cli: Callable, artifact: Callable, zoo_onnx: Callable) -> None:
    res = run_cli("verify", artifact("sensor-mlp", "riscv64-rvv"), "--model", zoo_onnx("sensor-mlp"),
                  "--emulate")
    assert res.code == 0, res.err
    assert "emulated=true" in res.out and "OK" in res.out


def test_manifest_records_c_libs(artifact: Callable) -> None:
    man = Manifest.read(artifact("sensor-mlp", "riscv64"))
    assert man.libs.runtime == "c"
    assert man.libs.infer == LIB_NAME and man.libs.runner == RUNNER_NAME
    assert set(man.files) >= {LIB_NAME, RUNNER_NAME, "params.npz"}


def test_missing_qemu_libc_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import compiler.emulate as emu

    monkeypatch.setitem(emu._C_QEMU, "riscv64", ("qemu-riscv64", str(tmp_path / "nolibc"), ()))
    with pytest.raises(EmulationError, match="no riscv64 C library"):
        runner_command(tmp_path / "fractal-run", "riscv64")




def test_c_artifact_serves_and_trains_like_the_vm(artifact: Callable, zoo_onnx: Callable) -> None:
    """x86_64-c through compile_model + load_artifact: inference and a training step agree with
    the Relax VM artifact of the same model (the node uses either through the same classes)."""
    settings = TrainSettings(loss="ce", optimizer="adam", lr=0.01, batch=4)
    c_art = load_artifact(artifact("sensor-mlp", "x86_64-c", settings))
    vm_art = load_artifact(artifact("sensor-mlp", host_preset_name(), settings))
    assert c_art.manifest.libs.runtime == "c"
    x = _x("sensor-mlp", 5, seed=3)  # 5 samples at batch 1: chunked like the VM
    np.testing.assert_allclose(c_art.infer({"x": x})["logits"], vm_art.infer({"x": x})["logits"], atol=TOL)
    ct, vt = c_art.trainer, vm_art.trainer
    assert ct is not None and vt is not None
    xb = _x("sensor-mlp", 4, seed=4)
    y = np.array([0, 1, 2, 1], np.int64)
    loss_c, grads_c = ct.loss_and_grad(c_art.params, xb, y)
    loss_v, grads_v = vt.loss_and_grad(vm_art.params, xb, y)
    assert abs(loss_c - loss_v) <= 1e-5
    for gc, gv in zip(grads_c, grads_v, strict=True):
        np.testing.assert_allclose(gc, gv, atol=1e-5)
    sc, sv = ct.init_state(c_art.params), vt.init_state(vm_art.params)
    pc, sc = ct.apply(c_art.params, grads_c, sc, lr=0.05)
    pv, sv = vt.apply(vm_art.params, grads_v, sv, lr=0.05)
    for a, b in zip([*pc, *sc], [*pv, *sv], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert int(sc[0]) == 1  # the step counter advanced
    # training lowers the loss after a few steps
    params, state = c_art.params, ct.init_state(c_art.params)
    first = None
    for _ in range(20):
        loss, grads = ct.loss_and_grad(params, xb, y)
        first = loss if first is None else first
        params, state = ct.apply(params, grads, state)
    assert loss < first


@pytest.mark.emulate
def test_riscv_training_runner_matches_host(artifact: Callable) -> None:
    """The riscv64-rvv training library (loss/grad + optimizer) under qemu agrees with x86_64-c."""
    settings = TrainSettings(loss="ce", optimizer="sgd", lr=0.1, batch=4)
    rv = artifact("digits-mlp", "riscv64-rvv", settings)
    host = load_artifact(artifact("digits-mlp", "x86_64-c", settings))
    xb = _x("digits-mlp", 4, seed=5)
    y = np.array([3, 1, 4, 1], np.int64)
    man = Manifest.read(rv)
    assert man.libs.train_runner is not None
    runner = rv / man.libs.train_runner
    out = run_c_runner(runner, "riscv64", "backbone_loss_adjoint", [xb, *host.params, y])
    loss, grads = host.trainer.loss_and_grad(host.params, xb, y)
    assert abs(float(out[0]) - loss) <= 1e-5
    for a, b in zip(out[1:], grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    state = host.trainer.init_state(host.params)
    lr = np.asarray(0.1, np.float32)
    new = run_c_runner(runner, "riscv64", "optimizer", [*host.params, *grads, *state, lr])
    want_p, want_s = host.trainer.apply(host.params, grads, state, lr=0.1)
    for a, b in zip(new, [*want_p, *want_s], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.emulate
@pytest.mark.slow
def test_every_coverage_op_on_riscv64_rvv_under_qemu(cb_dir: Path) -> None:
    """Every operator case of test_ops.py, compiled for riscv64-rvv and run under qemu-riscv64,
    matches onnxruntime (QDQ int8 within one output quantization step, as in test_ops.py).

    QDQ-int8 runs as rv64gc: Debian bookworm's qemu 7.2 aborts in its own RISC-V translator
    (``decode_save_opc: Assertion `ctx->insn_start != NULL'``) on that kernel's RVV code, an
    emulator bug rather than a wrong result; the rv64gc build runs the same kernels scalar."""
    import onnx
    import onnxruntime as ort

    from compiler import compile_model
    from compiler.emulate import run_emulated
    from tests.compiler.test_ops import CASES, QDQ_SCALE_OUT

    failures = []
    for name, make in CASES.items():
        model = make()
        path = cb_dir / f"op-{name}.onnx"
        onnx.save(model, str(path))
        rng = np.random.default_rng(11)
        inputs = {vi.name: rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim])
                  .astype(np.float32) for vi in model.graph.input}
        ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
        preset = "riscv64" if name == "QDQ-int8" else "riscv64-rvv"
        art = compile_model(path, target=preset, out_dir=cb_dir / f"op-{name}-{preset}", progress=False)
        got = run_emulated(art, inputs)["y"]
        tol = QDQ_SCALE_OUT + 1e-6 if name == "QDQ-int8" else TOL
        err = float(np.abs(got - ref).max())
        if got.shape != ref.shape or not err <= tol:
            failures.append(f"{name}: max abs error {err}")
    assert not failures, failures


@pytest.fixture(scope="session")
def riscv_sysroot() -> Path:
    """The Debian trixie riscv64 Python sysroot (python3.13 + numpy), built once by firmware/sysroot.sh."""
    from compiler.emulate import sysroot_dir

    root = sysroot_dir("riscv64")
    script = Path(__file__).resolve().parents[2] / "firmware" / "sysroot.sh"
    subprocess.run(["bash", str(script), "riscv64", str(root)], check=True, capture_output=True, timeout=900)
    return root


@pytest.mark.emulate
@pytest.mark.slow
def test_riscv64_python_loads_c_artifact_with_ctypes(riscv_sysroot: Path, artifact: Callable) -> None:
    """Python 3.13 on riscv64 (qemu, trixie sysroot) loads the riscv64-rvv artifact through
    load_artifact + ctypes and gives the runner's outputs bit for bit: the board-side path a
    riscv64 node uses, with no TVM installed."""
    from compiler.emulate import run_emulated

    art = artifact("sensor-mlp", "riscv64-rvv")
    x = {"x": _x("sensor-mlp", 3, seed=9)}
    via_python = run_emulated(art, x, python=True)
    via_runner = run_emulated(art, x)
    assert np.array_equal(via_python["logits"], via_runner["logits"])


@pytest.mark.emulate
@pytest.mark.slow
def test_riscv64_node_serves_under_qemu(riscv_sysroot: Path, artifact: Callable, zoo_onnx: Callable,
                                        tmp_path: Path) -> None:
    """`fractal node` itself on riscv64 (qemu-riscv64, trixie Python, RVV on) serves a riscv64-rvv
    artifact over the Open Inference Protocol and answers like onnxruntime."""
    import socket
    import time

    import httpx

    art = artifact("sensor-mlp", "riscv64-rvv")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "NODE.toml").write_text(f'node_id = "rv1"\nartifact = "{art}"\nport = {port}\n'
                                        f'data_dir = "{tmp_path / "data"}"\n')
    repo = Path(__file__).resolve().parents[2]
    # Debian trixie ships OpenSSL's legacy provider in a separate package the node does not need;
    # without this, importing cryptography (message signing) is fatal.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1",
           "HOME": str(tmp_path), "LANG": "C.UTF-8", "CRYPTOGRAPHY_OPENSSL_NO_LEGACY": "1"}
    cmd = ["qemu-riscv64", "-L", str(riscv_sysroot), "-cpu", "rv64,v=true,vlen=128,vext_spec=v1.0",
           str(riscv_sysroot / "usr/bin/python3.13"), "-c", "from api.cli import main; main()",
           "node", "--config", str(tmp_path / "NODE.toml")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240  # the emulated interpreter imports fastapi etc. slowly
        while True:  # readiness is an HTTP event; poll it (the process gives no other signal)
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(f"{base}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the riscv64 node did not become ready"
            time.sleep(0.5)
        info = httpx.get(f"{base}/v1/node", timeout=10).json()
        assert info["arch"] == "riscv64" and info["board"] == "riscv64-rvv"
        x = _x("sensor-mlp", 1, seed=12)
        body = {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": x.ravel().tolist()}]}
        r = httpx.post(f"{base}/v2/models/sensor-mlp/infer", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(1, 3)
        ref = next(iter(onnxruntime_reference(zoo_onnx("sensor-mlp"), {"x": x}, 1).values()))
        assert np.abs(got - ref).max() <= TOL
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
