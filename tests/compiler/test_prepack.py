"""Weight pre-packing (compiler/prepack.py): BatchNorm folded into the convolutions, parameter-only
work in ``main_transform_params`` run once per parameter set, correct across parameter swaps
(a committed round), the training module on the original layout."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from compiler import compile_model, host_preset_name, load_artifact, prepack, zoo
from compiler.importer import import_model
from edgenode.model import ModelHolder

TRIALS = 8


def _ort(model: onnx.ModelProto, x: np.ndarray, replace: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """onnxruntime on ``model`` with its initializers replaced by ``replace``, one sample at a time."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for init in model.graph.initializer:
        if replace and init.name in replace:
            init.CopyFrom(numpy_helper.from_array(replace[init.name], init.name))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run(None, {"x": x[i : i + 1]})[0] for i in range(len(x))])


def _perturbed(params: list[np.ndarray], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(p * (1 + 0.3 * rng.standard_normal(p.shape)) + 0.05).astype(p.dtype) for p in params]


def test_fold_batchnorm_leaves_no_batchnorm():
    from tests.compiler.models import small_cnn

    for model in (zoo.build("ds-cnn-kws"), small_cnn()[0]):  # conv without and with a bias
        mod = import_model(model).mod
        assert "batch_norm" in mod.script(show_meta=False)
        assert "batch_norm" not in prepack.fold_batchnorm(mod).script(show_meta=False)


def test_default_build_packs_params_and_follows_a_trained_round(cnn_artifact, cnn_onnx, tmp_path):
    """The small CNN (conv+bias+BatchNorm, trained with SGD): a training step changes the weights,
    the node commits them, inference on the packed new weights matches onnxruntime on them."""
    manifest = json.loads((cnn_artifact / "manifest.json").read_text())
    assert manifest["libs"]["transform"] == prepack.TRANSFORM_FUNC
    art = load_artifact(cnn_artifact)
    trainer = art.trainer
    assert trainer is not None
    model = onnx.load(str(cnn_onnx))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(art.infer({"x": x})["logits"], _ort(model, x), atol=1e-4)

    # one training step on the original (ONNX) layout: what a round computes
    xb = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    _, grads = trainer.loss_and_grad(art.params, xb, np.array([0, 1, 2, 3]))
    new, _ = trainer.apply(art.params, grads, trainer.init_state(art.params), lr=0.5)
    assert [p.shape for p in new] == [p.shape for p in art.params]
    holder = ModelHolder(art, tmp_path / "node")
    before = holder.snapshot.prepared  # what an inference in flight during the swap still uses
    holder.commit(new, 1)
    want = _ort(model, x, dict(zip(art.param_names, new, strict=True)))
    assert not np.allclose(want, _ort(model, x), atol=1e-3)  # the round really changed the model
    np.testing.assert_allclose(holder.infer({"x": x})["logits"], want, atol=1e-4)
    # the new packed set is fresh memory: the old one is untouched
    np.testing.assert_allclose(art.infer({"x": x}, params=before)["logits"], _ort(model, x), atol=1e-4)


@pytest.mark.slow
def test_tuned_prepacked_ds_cnn_matches_onnxruntime_across_swaps(tmp_path):
    """ds-cnn-kws tuned with a few trials and pre-packing: inference matches onnxruntime on the
    shipped weights, on swapped weights (a committed round), and back after a rollback."""
    onnx_path = zoo.save("ds-cnn-kws", tmp_path / "ds-cnn-kws.onnx")
    out = compile_model(onnx_path, target=host_preset_name(), out_dir=tmp_path / "art", tune=True,
                        trials=TRIALS, db_dir=tmp_path / "db", progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["libs"]["transform"] == prepack.TRANSFORM_FUNC
    assert manifest["tuning"]["schedule"] == "tuned"
    art = load_artifact(out)
    model = onnx.load(str(onnx_path))
    x = np.random.default_rng(1).standard_normal((2, 1, 49, 10)).astype(np.float32)
    np.testing.assert_allclose(art.infer({"x": x})[art.outputs[0].name], _ort(model, x), atol=1e-4)
    # main takes the packed parameters: BatchNorm folded, so fewer of them than the ONNX ones
    assert len(art.prepare_params(art.params).tensors) < len(art.params)

    holder = ModelHolder(art, tmp_path / "node")
    for version, seed in ((1, 11), (2, 12)):
        new = _perturbed(art.params, seed)
        holder.commit(new, version)
        want = _ort(model, x, dict(zip(art.param_names, new, strict=True)))
        np.testing.assert_allclose(holder.infer({"x": x})[art.outputs[0].name], want, rtol=1e-4, atol=1e-4)
    holder.rollback(0)
    np.testing.assert_allclose(holder.infer({"x": x})[art.outputs[0].name], _ort(model, x), atol=1e-4)
