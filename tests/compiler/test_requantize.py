"""compiler/requantize.py and the manifest's ``quantization`` (``--train --quantize int8``), without a
compile: the record round-trips and refuses paths leaving the artifact; trained parameters map back
onto the float model's initializers by name, and a parameter that does not is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from compiler import zoo
from compiler.errors import ArtifactError
from compiler.manifest import Manifest, QuantizationInfo, QuantSettings
from compiler.quantize import check_params_map, float_model_with_params


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], list[np.ndarray]]:
    path = Path(zoo.save("digits-mlp", tmp_path_factory.mktemp("rq") / "digits.onnx"))
    m = onnx.load(str(path))
    names = [i.name for i in m.graph.initializer]
    return path, names, [numpy_helper.to_array(i).astype(np.float32) for i in m.graph.initializer]


def test_quantization_record_round_trips(compiler_digits_artifact, tmp_path):
    man = Manifest.read(compiler_digits_artifact)
    assert man.quantization is None and "quantization" not in man.to_json()  # float artifacts unchanged
    q = QuantizationInfo("int8", "int8", "model.float.onnx", QuantSettings(per_channel=False), 400, True)
    data = {**man.to_json(), "quantization": q.to_json()}
    assert Manifest.from_json(data).quantization == q
    for bad in ("../int8", "/abs"):
        with pytest.raises(ArtifactError, match="leaves the artifact directory"):
            Manifest.from_json({**data, "quantization": {**q.to_json(), "library": bad}})
    (tmp_path / "manifest.json").write_text(json.dumps({**data, "quantization": {"mode": "int8"}}))
    with pytest.raises(ArtifactError, match="lacks the 'library' field"):
        Manifest.read(tmp_path)


def test_trained_params_go_back_into_the_float_model(mlp, tmp_path):
    path, names, params = mlp
    check_params_map(path, names, params)
    trained = [p * 2 + 1 for p in params]
    out = float_model_with_params(path, names, trained, tmp_path / "trained.onnx")
    got = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(out)).graph.initializer}
    for n, p in zip(names, trained, strict=True):
        np.testing.assert_array_equal(got[n], p)
    check_params_map(out, names, trained)


def test_a_parameter_the_preparation_changed_is_refused(mlp):
    path, names, params = mlp
    changed = [p.copy() for p in params]
    changed[0] += 1
    with pytest.raises(ArtifactError, match=f"parameter {names[0]!r} is not an initializer"):
        check_params_map(path, names, changed)
    with pytest.raises(ArtifactError, match="'nope' is not an initializer"):
        check_params_map(path, ["nope"], params[:1])
