"""The real tritonclient.http client against the node served by uvicorn on a loopback port."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def client(server):
    c = triton.InferenceServerClient(server.url.removeprefix("http://"), connection_timeout=10,
                                     network_timeout=30)
    yield c
    c.close()


@pytest.fixture(scope="module")
def x(api_node):
    spec = api_node.inputs[0]
    return np.random.default_rng(7).standard_normal((5, *spec.shape[1:])).astype(np.float32)


def _input(api_node, x, binary):
    spec = api_node.inputs[0]
    inp = triton.InferInput(spec.name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    return inp


def test_health_and_metadata(client, api_node):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(api_node.model_name)
    assert not client.is_model_ready("no-such-model")
    meta = client.get_model_metadata(api_node.model_name)
    assert meta["name"] == api_node.model_name
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        (s.name, "FP32", [-1, *s.shape[1:]]) for s in api_node.inputs]
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["outputs"]] == [
        (s.name, "FP32", [-1, *s.shape[1:]]) for s in api_node.outputs]
    server_meta = client.get_server_metadata()
    assert "binary_tensor_data" in server_meta["extensions"]
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("no-such-model")


@pytest.mark.parametrize("binary_in", [True, False], ids=["bin-in", "json-in"])
@pytest.mark.parametrize("binary_out", [None, True, False], ids=["default-out", "bin-out", "json-out"])
def test_infer_matches_direct_call(client, api_node, reference_infer, x, binary_in, binary_out):
    out_name = api_node.outputs[0].name
    outputs = None if binary_out is None else [triton.InferRequestedOutput(out_name, binary_data=binary_out)]
    res = client.infer(api_node.model_name, [_input(api_node, x, binary_in)], outputs=outputs,
                       request_id="req-42")
    assert res.get_response()["id"] == "req-42"
    got = res.as_numpy(out_name)
    want = reference_infer(x)[out_name]
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("algo", ["gzip", "deflate"])
def test_infer_compressed_request(client, api_node, reference_infer, x, algo):
    out_name = api_node.outputs[0].name
    res = client.infer(api_node.model_name, [_input(api_node, x, True)], request_compression_algorithm=algo)
    np.testing.assert_allclose(res.as_numpy(out_name), reference_infer(x)[out_name], atol=1e-5, rtol=0)


def test_infer_errors_surface_in_client(client, api_node, x):
    spec = api_node.inputs[0]
    bad = triton.InferInput(spec.name, [5, spec.shape[1] + 1], "FP32")
    bad.set_data_from_numpy(np.zeros((5, spec.shape[1] + 1), np.float32))
    with pytest.raises(InferenceServerException, match="shape"):
        client.infer(api_node.model_name, [bad])
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("no-such-model", [_input(api_node, x, True)])
    top3 = triton.InferRequestedOutput(api_node.outputs[0].name, class_count=3)
    with pytest.raises(InferenceServerException, match="classification extension is not supported"):
        client.infer(api_node.model_name, [_input(api_node, x, True)], outputs=[top3])


def test_infer_matches_fractal_predict(client, api_node, x, tmp_path):
    """Same input through tritonclient -> HTTP -> node and through the `fractal predict` CLI."""
    from api.cli import main

    assert api_node.model_version == 0  # predict uses the artifact's shipped parameters
    np.savez(tmp_path / "in.npz", **{api_node.inputs[0].name: x})
    with pytest.raises(SystemExit) as done:
        main(["predict", str(api_node.config.artifact), "--input", str(tmp_path / "in.npz"),
              "--output", str(tmp_path / "out.npz")])
    assert done.value.code in (0, None)
    out_name = api_node.outputs[0].name
    with np.load(tmp_path / "out.npz") as z:
        want = z[out_name]
    got = client.infer(api_node.model_name, [_input(api_node, x, True)]).as_numpy(out_name)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.abs(want).max() > 1e-3  # a real, non-trivial output
