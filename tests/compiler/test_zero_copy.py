"""Artifact.infer and Trainer pass arrays to TVM by DLPack: results must still be owned arrays.

Zero-copy must never let a caller see (or corrupt) memory the runtime or another result shares:
outputs that alias an input or a parameter are copied, inputs of any layout give the same answer.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler import compile_model, host_preset_name, load_artifact
from compiler.artifact import aligned_copy


def _misaligned(x: np.ndarray) -> np.ndarray:
    buf = np.empty(x.nbytes + 64 + x.itemsize, dtype=x.dtype)
    start = next(i for i in range(1, 64) if (buf.ctypes.data + i * x.itemsize) % 64)
    out = buf[start:start + x.size].reshape(x.shape)
    out[...] = x
    assert out.ctypes.data % 64
    return out


def test_inputs_of_any_layout_give_the_same_outputs(compiler_digits_artifact):
    art = load_artifact(compiler_digits_artifact)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    want = art.infer({"x": aligned_copy(x)})["logits"]
    readonly = x.copy()
    readonly.flags.writeable = False
    strided = np.asfortranarray(x)
    for variant in (x, _misaligned(x), readonly, strided, x.tolist()):
        arr = np.asarray(variant, dtype=np.float32) if isinstance(variant, list) else variant
        np.testing.assert_array_equal(art.infer({"x": arr})["logits"], want)
    # a single misaligned sample goes through the per-thread staging buffer: no cross-talk
    a, b = _misaligned(x[:1]), _misaligned(x[1:2])
    ra, rb = art.infer({"x": a})["logits"], art.infer({"x": b})["logits"]
    np.testing.assert_array_equal(ra, want[:1])
    np.testing.assert_array_equal(rb, want[1:2])


def test_outputs_are_independent_of_inputs_and_later_calls(compiler_digits_artifact):
    art = load_artifact(compiler_digits_artifact)
    x = aligned_copy(np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32))
    first = art.infer({"x": x})["logits"]
    keep = first.copy()
    x[...] = 0.0  # the caller reuses its input buffer
    second = art.infer({"x": x})["logits"]
    third = art.infer({"x": x})["logits"]
    np.testing.assert_array_equal(first, keep)
    assert not np.shares_memory(second, third)
    first[...] = 123.0  # results are writable and owned: writing one changes nothing else
    np.testing.assert_array_equal(art.infer({"x": x})["logits"], second)


@pytest.fixture(scope="module")
def alias_artifact(tmp_path_factory):
    """y = Identity(x) and w_out = Identity(w): both outputs alias a VM argument."""
    w = np.arange(4, dtype=np.float32).reshape(1, 4)
    nodes = [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Identity", ["w"], ["w_out"])]
    graph = helper.make_graph(
        nodes, "alias",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4]),
         helper.make_tensor_value_info("w_out", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    d = tmp_path_factory.mktemp("alias")
    onnx.save(model, d / "alias.onnx")
    return compile_model(d / "alias.onnx", target=host_preset_name(), out_dir=d / "art", progress=False)


def test_outputs_aliasing_an_input_or_a_parameter_are_copied(alias_artifact):
    art = load_artifact(alias_artifact)
    x = aligned_copy(np.ones((1, 4), np.float32))
    out = art.infer({"x": x})
    np.testing.assert_array_equal(out["y"], x)
    np.testing.assert_array_equal(out["w_out"], np.arange(4, dtype=np.float32).reshape(1, 4))
    assert not np.shares_memory(out["y"], x)
    out["y"][...] = -1.0
    out["w_out"][...] = -1.0  # must not reach a constant or parameter the VM keeps
    np.testing.assert_array_equal(x, 1.0)
    again = art.infer({"x": x})
    np.testing.assert_array_equal(again["w_out"], np.arange(4, dtype=np.float32).reshape(1, 4))
    np.testing.assert_array_equal(again["y"], x)


def test_trainer_results_are_owned_and_steps_bit_identical(compiler_digits_artifact):
    tr = load_artifact(compiler_digits_artifact).trainer
    params = load_artifact(compiler_digits_artifact).params
    rng = np.random.default_rng(3)
    x = _misaligned(rng.standard_normal((tr.batch, 64)).astype(np.float32))
    y = rng.integers(0, 10, tr.batch)
    loss, grads = tr.loss_and_grad(params, x, y)
    keep = [g.copy() for g in grads]
    for g in grads:  # e.g. an in-place allreduce: must not reach the VM or the next call
        g *= 0.5
    loss2, grads2 = tr.loss_and_grad(params, x, y)
    assert loss2 == loss
    for a, b in zip(grads2, keep, strict=True):
        np.testing.assert_array_equal(a, b)
    state = tr.init_state(params)
    new, new_state = tr.apply(params, grads2, state)
    arrays = [*params, *grads2, *state, *new, *new_state]
    for i, a in enumerate(arrays):
        assert a.flags.writeable
        for b in arrays[i + 1:]:
            assert not np.shares_memory(a, b)
    again, _ = tr.apply([p.copy() for p in params], [g.copy() for g in grads2], state)
    for a, b in zip(new, again, strict=True):
        assert a.tobytes() == b.tobytes()
