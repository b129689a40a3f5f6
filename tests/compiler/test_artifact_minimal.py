"""compiler.artifact must run where only tvm, tvm_ffi and numpy exist (the aarch64 sysroot under
qemu, the boards): load + infer + a training step with every other package made unimportable."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler import TrainSettings, compile_model, host_preset_name, load_artifact

_SCRIPT = textwrap.dedent("""
    import sys
    BLOCKED = {"onnx", "onnxruntime", "pydantic", "typer", "rich", "torch", "sklearn", "api",
               "edgenode", "federation", "platformdirs"}

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked import of {name}")
            return None

    sys.meta_path.insert(0, Block())
    import numpy as np
    from compiler import load_artifact
    art = load_artifact(sys.argv[1])
    out = art.infer({"x": np.ones((3, 64), np.float32)})["logits"]
    tr = art.trainer
    state = tr.init_state(art.params)
    loss, grads = tr.loss_and_grad(art.params, np.ones((32, 64), np.float32), np.zeros(32, np.int64))
    params, state = tr.apply(art.params, grads, state, lr=0.05)
    np.save(sys.argv[2], out)
    print(repr(loss))
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
""")


def test_artifact_runtime_needs_only_numpy_and_tvm(compiler_digits_artifact, tmp_path):
    script = tmp_path / "minimal.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(compiler_digits_artifact), str(tmp_path / "o.npy")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
        env={
            "PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[2]),
            "PATH": "/usr/bin:/bin",
        },
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    art = load_artifact(compiler_digits_artifact)
    want = art.infer({"x": np.ones((3, 64), np.float32)})["logits"]
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), want)
    loss, _ = art.trainer.loss_and_grad(art.params, np.ones((32, 64), np.float32), np.zeros(32, np.int64))
    assert float(proc.stdout.strip()) == loss


@pytest.mark.parametrize("shape", [[1, -1], [1, 48]])
def test_training_rebatches_reshape_that_hard_codes_batch_one(tmp_path, shape):
    """The ONNX model has batch 1 and a Reshape to [1, ...]; the training module runs at batch 4."""
    rng = np.random.default_rng(0)
    w = {
        "cw": rng.standard_normal((3, 3, 1, 1)).astype(np.float32),
        "shape": np.array(shape, np.int64),
        "fw": (0.2 * rng.standard_normal((48, 5))).astype(np.float32),
        "fb": np.zeros(5, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "cw"], ["c"]),
        helper.make_node("Reshape", ["c", "shape"], ["r"]),
        helper.make_node("Gemm", ["r", "fw", "fb"], ["y"]),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        [numpy_helper.from_array(v, k) for k, v in w.items()],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, str(tmp_path / "rs.onnx"))
    art = load_artifact(
        compile_model(
            tmp_path / "rs.onnx",
            target=host_preset_name(),
            out_dir=tmp_path / "a",
            train=TrainSettings(batch=4),
            progress=False,
        )
    )
    assert art.param_names == ["cw", "fw", "fb"]  # the int64 shape is a constant, not a parameter
    x = rng.standard_normal((4, 3, 4, 4)).astype(np.float32)
    y = np.array([0, 1, 2, 3])
    loss, _ = art.trainer.loss_and_grad(art.params, x, y)
    logits = art.infer({"x": x})["y"].astype(np.float64)
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    assert loss == pytest.approx(-logp[np.arange(4), y].mean(), rel=1e-5)
