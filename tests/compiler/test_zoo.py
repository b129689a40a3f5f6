"""The zoo's models are valid ONNX, run in onnxruntime, and have the documented shapes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from compiler import zoo
from compiler.errors import ModelError

OUT_SHAPES = {
    "ds-cnn-kws": ("logits", (12,)),
    "mobilenet-v1-0.25-vww": ("logits", (2,)),
    "resnet8-cifar10": ("logits", (10,)),
    "fc-autoencoder": ("recon", (640,)),
    "sensor-mlp": ("logits", (3,)),
    "digits-mlp": ("logits", (10,)),
}


def _run(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {"x": x}), strict=True))


def test_names_cover_the_brief():
    assert set(zoo.NAMES) == set(OUT_SHAPES)


@pytest.mark.parametrize("name", zoo.NAMES)
@pytest.mark.parametrize("batch", [1, 3])
def test_model_checks_and_runs(name, batch):
    m = zoo.build(name, batch=batch)
    onnx.checker.check_model(m, full_check=True)
    assert m.ir_version <= 10 and max(o.version for o in m.opset_import) <= 21
    assert [i.name for i in m.graph.input] == ["x"]
    x = np.random.default_rng(1).standard_normal(zoo.input_shape(name, batch=batch)).astype(np.float32)
    out_name, out_shape = OUT_SHAPES[name]
    y = _run(m, x)
    assert list(y) == [out_name]
    assert y[out_name].shape == (batch, *out_shape)
    assert y[out_name].dtype == np.float32
    assert np.isfinite(y[out_name]).all()
    # He-scaled weights keep activations O(1): neither vanished nor exploded
    assert 1e-3 < float(np.abs(y[out_name]).mean()) < 1e3
    # rows are independent samples: row 0 of the batch equals a batch-1 run on that row
    if batch > 1:
        y1 = _run(zoo.build(name, batch=1), x[:1])[out_name]
        np.testing.assert_allclose(y[out_name][:1], y1, rtol=1e-5, atol=1e-5)


def test_seed_makes_weights_deterministic():
    a, b, c = (zoo.build("digits-mlp", seed=s) for s in (0, 0, 1))
    assert a.SerializeToString() == b.SerializeToString()
    assert a.graph.initializer[0].raw_data != c.graph.initializer[0].raw_data


def test_digits_mlp_contract():
    m = zoo.build("digits-mlp", batch=5)
    (i,), (o,) = m.graph.input, m.graph.output
    assert (i.name, [d.dim_value for d in i.type.tensor_type.shape.dim]) == ("x", [5, 64])
    assert (o.name, [d.dim_value for d in o.type.tensor_type.shape.dim]) == ("logits", [5, 10])


def test_mlperf_parameter_counts():
    # the published MLPerf Tiny sizes (DS-CNN-S ~24k, MobileNetV1-0.25 ~221k, ResNet-8 ~78k,
    # FC-AE ~270k); counts include BN statistics
    def count(n):
        return sum(int(np.prod(t.dims)) for t in zoo.build(n).graph.initializer)
    assert 20_000 < count("ds-cnn-kws") < 30_000
    assert 200_000 < count("mobilenet-v1-0.25-vww") < 240_000
    assert 70_000 < count("resnet8-cifar10") < 90_000
    assert 250_000 < count("fc-autoencoder") < 290_000


def test_save_round_trips(tmp_path):
    p = zoo.save("sensor-mlp", tmp_path / "sub" / "m.onnx", batch=2, seed=3)
    expected = zoo.build("sensor-mlp", batch=2, seed=3).SerializeToString()
    assert onnx.load(str(p)).SerializeToString() == expected


@pytest.mark.parametrize("kw", [{"name": "nope"}, {"name": "digits-mlp", "batch": 0}])
def test_bad_arguments_are_model_errors(kw):
    name = kw.pop("name")
    with pytest.raises(ModelError) as ei:
        zoo.build(name, **kw)
    assert ei.value.hint
