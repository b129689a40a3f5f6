"""Training targets the compiled loss must never see (issue 26, finding 3): class ids outside the
model's classes, non-integer or non-finite class ids, non-finite regression targets.

Before the fix, a class id of 1e9 or +-1e12 made the compiled loss read out of bounds (a segfault
in ``Trainer.loss_and_grad`` for the Relax VM and the C library, and in ``train-fractal-run``),
and -1 or 10 for a 10-class model gave a silently wrong loss. Every entry point refuses them now:
the library with an :class:`InputError` (the compiler's error tree) and a hint, the C library
and its runner from inside the compiled code (a caller that bypasses Python is refused too),
the runner with one ``error:`` line and exit status 1, never a signal.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from compiler import InputError, load_artifact
from compiler.clib import CLibrary
from compiler.emulate import runner_command
from compiler.manifest import Manifest
from compiler.trainbuild import ADJOINT_FUNC

BAD_IDS = [10**9, 10**12, -(10**12), -1, 10]  # digits-mlp has 10 classes


def _x(batch: int, features: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, features)).astype(np.float32)


def _ids(batch: int, bad: int, at: int = 1) -> np.ndarray:
    y = np.arange(batch, dtype=np.int64) % 10
    y[at] = bad
    return y


@pytest.fixture(scope="module")
def c_digits(compiler_build_dir: Path, compiler_digits_onnx: Path) -> Path:
    """digits-mlp for x86_64-c with training (ce, sgd, batch 4)."""
    from compiler import TrainSettings, compile_model

    return compile_model(compiler_digits_onnx, target="x86_64-c",
                         out_dir=compiler_build_dir / "digits-c-train",
                         train=TrainSettings(loss="ce", optimizer="sgd", lr=0.1, batch=4), progress=False)


@pytest.fixture(scope="module")
def c_mse(compiler_build_dir: Path, mlp_onnx: Path) -> Path:
    """The tiny 8-16-4 MLP for x86_64-c with training (mse, sgd, batch 3)."""
    from compiler import TrainSettings, compile_model

    return compile_model(mlp_onnx, target="x86_64-c", out_dir=compiler_build_dir / "mlp-c-mse",
                         train=TrainSettings(loss="mse", optimizer="sgd", lr=0.1, batch=3), progress=False)


@pytest.mark.parametrize("bad", BAD_IDS)
@pytest.mark.parametrize("route", ["vm", "c"])
def test_trainer_refuses_class_ids_out_of_range(route: str, bad: int, compiler_digits_artifact: Path,
                                                c_digits: Path) -> None:
    art = load_artifact(compiler_digits_artifact if route == "vm" else c_digits)
    tr = art.trainer
    assert tr is not None
    x = _x(tr.batch, 64)
    with pytest.raises(InputError, match=rf"targets\[1\] = {bad} is not a class id in \[0, 10\)") as err:
        tr.loss_and_grad(art.params, x, _ids(tr.batch, bad))
    assert err.value.hint and "10 classes" in err.value.hint
    # the trainer still works on good labels afterwards (and -1 / 10 did not reach the loss)
    loss, _ = tr.loss_and_grad(art.params, x, _ids(tr.batch, 3))
    assert np.isfinite(loss)


@pytest.mark.parametrize("y", [np.array([0.0, 1.5, 2.0, 3.0]), np.array([0.0, np.nan, 2.0, 3.0]),
                               np.array([0.0, np.inf, 2.0, 3.0]), np.array([0, 2**63 + 5, 1, 2], np.uint64)],
                         ids=["fraction", "nan", "inf", "uint64-wraps"])
def test_trainer_refuses_non_integer_class_ids(y: np.ndarray, c_digits: Path) -> None:
    art = load_artifact(c_digits)
    assert art.trainer is not None
    with pytest.raises(InputError, match=r"targets\[1\] = .* is not a class id"):
        art.trainer.loss_and_grad(art.params, _x(4, 64), y)


@pytest.mark.parametrize("route", ["vm", "c"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_trainer_refuses_non_finite_mse_targets(route: str, bad: float, mse_adam_artifact: Path,
                                                c_mse: Path) -> None:
    art = load_artifact(mse_adam_artifact if route == "vm" else c_mse)
    tr = art.trainer
    assert tr is not None
    y = np.zeros(tr.target_spec.shape, np.float32)
    y.flat[2] = bad
    with pytest.raises(InputError, match=r"targets contain NaN or Inf \(element 2"):
        tr.loss_and_grad(art.params, _x(tr.batch, 8), y)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_trainer_refuses_non_finite_inputs(bad: float, mse_adam_artifact: Path) -> None:
    """Inference takes NaN and infinity (IEEE values); a training step never does: one such
    sample would make the gradient, and every member's parameters after the round, NaN."""
    art = load_artifact(mse_adam_artifact)
    tr = art.trainer
    assert tr is not None
    x = _x(tr.batch, 8)
    x[1, 3] = bad
    with pytest.raises(InputError, match=r"training input .* holds NaN or infinity"):
        tr.loss_and_grad(art.params, x, np.zeros(tr.target_spec.shape, np.float32))
    # inference: infinities pass Gemm and Relu as ONNX says; NaN would come out of Relu as 0
    # (TVM's max drops it), so this model refuses NaN by name (compiler/nonfinite.py)
    assert art.manifest.nonfinite.nan == "Relu" and art.manifest.nonfinite.inf == ""
    if np.isnan(bad):
        with pytest.raises(InputError, match=r"holds NaN, which this model refuses: its Relu"):
            art.infer({art.inputs[0].name: x})
    else:
        out = next(iter(art.infer({art.inputs[0].name: x}).values()))
        assert np.isfinite(np.delete(out, 1, axis=0)).all() and not np.isfinite(out[1]).all()


@pytest.mark.parametrize("bad", BAD_IDS)
def test_c_library_checks_class_ids_itself(bad: int, c_digits: Path) -> None:
    """The compiled entry point refuses them even when the Trainer's checks are bypassed."""
    man = Manifest.read(c_digits)
    art = load_artifact(c_digits)
    assert man.libs.train is not None
    lib = CLibrary(c_digits / man.libs.train)
    with pytest.raises(InputError, match=rf"targets\[2\] = {bad} is not a class id in \[0, 10\)"):
        lib.call(ADJOINT_FUNC, [_x(4, 64), *art.params, _ids(4, bad, at=2)])


def test_c_library_checks_mse_targets_itself(c_mse: Path) -> None:
    man = Manifest.read(c_mse)
    art = load_artifact(c_mse)
    assert man.libs.train is not None
    y = np.zeros((3, 4), np.float32)
    y[1, 2] = np.nan
    with pytest.raises(InputError, match=r"targets\[6\] is NaN or infinite"):
        CLibrary(c_mse / man.libs.train).call(ADJOINT_FUNC, [_x(3, 8), *art.params, y])


def run_train_runner(art_dir: Path, arch: str, inputs: list[np.ndarray],
                     tmp: Path) -> subprocess.CompletedProcess:
    """``train-fractal-run backbone_loss_adjoint IN OUT`` (under qemu-user for a foreign arch)."""
    man = Manifest.read(art_dir)
    assert man.libs.train_runner is not None
    ind, outd = tmp / "in", tmp / "out"
    ind.mkdir(exist_ok=True)
    outd.mkdir(exist_ok=True)
    for i, a in enumerate(inputs):
        np.save(ind / f"{i}.npy", a)
    cmd = [*runner_command(art_dir / man.libs.train_runner, arch), ADJOINT_FUNC, str(ind), str(outd)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def assert_refused(proc: subprocess.CompletedProcess, pattern: str) -> None:
    import re

    assert proc.returncode == 1, (proc.returncode, proc.stderr)  # a signal would be negative
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_train_runner_refuses_class_ids(bad: int, c_digits: Path, tmp_path: Path) -> None:
    params = load_artifact(c_digits).params
    proc = run_train_runner(c_digits, "x86_64", [_x(4, 64), *params, _ids(4, bad, at=3)], tmp_path)
    assert_refused(proc, rf"targets\[3\] = {bad} is not a class id in \[0, 10\)")
    ok = run_train_runner(c_digits, "x86_64", [_x(4, 64), *params, _ids(4, 9, at=3)], tmp_path)
    assert ok.returncode == 0, ok.stderr


def test_train_runner_refuses_non_finite_mse_targets(c_mse: Path, tmp_path: Path) -> None:
    y = np.zeros((3, 4), np.float32)
    y[2, 0] = -np.inf
    proc = run_train_runner(c_mse, "x86_64", [_x(3, 8), *load_artifact(c_mse).params, y], tmp_path)
    assert_refused(proc, r"targets\[8\] is NaN or infinite")


@pytest.mark.emulate
def test_riscv64_train_runner_refuses_class_ids(compiler_build_dir: Path, compiler_digits_onnx: Path,
                                                c_digits: Path, tmp_path: Path) -> None:
    """The same check compiled for riscv64 (RVV), run under qemu-riscv64: an error, not a signal."""
    from compiler import TrainSettings, compile_model

    rv = compile_model(compiler_digits_onnx, target="riscv64-rvv",
                       out_dir=compiler_build_dir / "digits-rv-train",
                       train=TrainSettings(loss="ce", optimizer="sgd", lr=0.1, batch=4), progress=False)
    params = load_artifact(c_digits).params  # the same ONNX: the same parameters
    for bad in (10**12, -1):
        proc = run_train_runner(rv, "riscv64", [_x(4, 64), *params, _ids(4, bad, at=0)], tmp_path)
        assert_refused(proc, rf"targets\[0\] = {bad} is not a class id in \[0, 10\)")

