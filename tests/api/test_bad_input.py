"""Every kind of bad request gets the right 4xx with a message naming the problem (never a 5xx)."""

from __future__ import annotations

import json

import httpx
import pytest


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _tensor(api_node, n=1, **over):
    spec = api_node.inputs[0]
    width = spec.shape[1]
    t = {"name": spec.name, "shape": [n, width], "datatype": "FP32", "data": [0.5] * (n * width)}
    t.update(over)
    return t


def _infer_cases(node):
    name, width, model = node.inputs[0].name, node.inputs[0].shape[1], node.model_name
    ok = _tensor(node)
    return [
        # (id, model, raw body, status, message fragment)
        ("wrong-shape", model, {"inputs": [_tensor(node, shape=[1, width + 3], data=[0.1] * (width + 3))]},
         400, "has shape [1, "),
        ("wrong-rank", model, {"inputs": [_tensor(node, shape=[width])]}, 400, "shape"),
        # empty tensors: only a model compiled with an empty input takes one (tests/api/test_dynshape_node.py)
        ("empty-batch", model, {"inputs": [_tensor(node, n=0)]}, 400, "with N >= 1"),
        ("empty-dim", model, {"inputs": [_tensor(node, shape=[1, 0], data=[])]}, 400, "has shape [1, 0]"),
        ("data-count", model, {"inputs": [_tensor(node, data=[0.1] * (width - 1))]}, 400, "elements"),
        ("wrong-datatype", model, {"inputs": [_tensor(node, datatype="INT32", data=[0] * width)]}, 400,
         "has dtype int32, expected float32"),
        ("float-data-int-datatype", model, {"inputs": [_tensor(node, datatype="INT32")]}, 400,
         "must hold integers for INT32"),
        ("unknown-datatype", model, {"inputs": [_tensor(node, datatype="FLOAT")]}, 400, "datatype"),
        ("missing-input", model, {"inputs": []}, 400, f"missing input(s) '{name}'"),
        ("missing-inputs-key", model, {"id": "a"}, 400, "missing 'inputs'"),
        ("unknown-input", model, {"inputs": [ok, _tensor(node, name="bogus")]}, 400,
         "unknown input(s) 'bogus'"),
        ("duplicate-input", model, {"inputs": [ok, ok]}, 400, "given twice"),
        ("string-data", model, {"inputs": [_tensor(node, data=["a"] * width)]}, 400, "only numbers"),
        ("null-data", model, {"inputs": [_tensor(node, data=[None] * width)]}, 400, "only numbers"),
        ("ragged-data", model, {"inputs": [_tensor(node, data=[[0.1], [0.1, 0.2]])]}, 400, "ragged"),
        ("no-data", model, {"inputs": [{k: v for k, v in ok.items() if k != "data"}]}, 400, "no 'data'"),
        # a finite number with no FP32 value: the client declared the wrong datatype (NaN and
        # Infinity are IEEE values inference takes: tests/api/test_nonfinite_inputs.py)
        ("fp32-overflow", model, {"inputs": [_tensor(node, data=[1e39] * width)]}, 400, "out of FP32 range"),
        ("unknown-output", model, {"inputs": [ok], "outputs": [{"name": "nope"}]}, 400,
         "unknown output 'nope'"),
        ("not-an-object", model, [1, 2], 400, "JSON object"),
        ("unknown-model", "no-such-model", {"inputs": [ok]}, 404, "unknown model 'no-such-model'"),
    ]


def test_infer_bad_inputs(http, api_node):
    for case_id, model, body, status, fragment in _infer_cases(api_node):
        r = http.post(f"/v2/models/{model}/infer", json=body)
        assert r.status_code == status, (case_id, r.text)
        assert fragment in r.json()["error"], (case_id, r.text)


@pytest.mark.parametrize("raw, fragment", [
    (b"{not json", "malformed JSON"),
    (b"", "malformed JSON"),
    (b"\xff\xfe", "malformed JSON"),
    (b'{"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": [nan]}]}', "malformed JSON"),
    (b'{"inputs": [{"name": "x", "shape": [NaN, 64], "datatype": "FP32", "data": []}]}',
     "must be an integer"),
    (b"[" * 100_000 + b"]" * 100_000, "malformed JSON"),
], ids=["syntax", "empty", "not-utf8", "lowercase-nan", "nan-dimension", "deep-nesting"])
def test_infer_malformed_json(http, api_node, raw, fragment):
    r = http.post(f"/v2/models/{api_node.model_name}/infer", content=raw,
                  headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]


def test_binary_extension_errors(http, api_node):
    spec = api_node.inputs[0]
    head = json.dumps({"inputs": [{"name": spec.name, "shape": [1, spec.shape[1]], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 4 * spec.shape[1]}}]}).encode()
    url = f"/v2/models/{api_node.model_name}/infer"
    hlen = {"inference-header-content-length": str(len(head))}
    short = http.post(url, content=head + b"\0" * 8, headers=hlen)
    assert short.status_code == 400 and "truncated" in short.json()["error"]
    extra = http.post(url, content=head + b"\0" * (4 * spec.shape[1] + 3),
                      headers={"inference-header-content-length": str(len(head))})
    assert extra.status_code == 400 and "unaccounted" in extra.json()["error"]
    bad_len = http.post(url, content=head, headers={"inference-header-content-length": "99999"})
    assert bad_len.status_code == 400 and "Inference-Header-Content-Length" in bad_len.json()["error"]
    bad_enc = http.post(url, content=head, headers={"content-encoding": "br"})
    assert bad_enc.status_code == 415 and "Content-Encoding" in bad_enc.json()["error"]
    not_gzip = http.post(url, content=head, headers={"content-encoding": "gzip"})
    assert not_gzip.status_code == 400 and "gzip" in not_gzip.json()["error"]


def _sample(api_node):
    return [0.25] * api_node.inputs[0].shape[1]


def test_samples_bad_inputs(http, api_node):
    name, s = api_node.inputs[0].name, _sample(api_node)
    cases = [
        ("label-count", {"inputs": {name: [s, s]}, "labels": [1]},
         "label count mismatch: 1 labels for 2 samples"),
        ("no-labels", {"inputs": {name: [s]}}, "missing 'labels'"),
        ("wrong-shape", {"inputs": {name: [s + [0.0]]}, "labels": [1]}, "samples have shape"),
        ("unknown-input", {"inputs": {"bogus": [s]}, "labels": [1]}, "unknown input 'bogus'"),
        ("missing-input", {"inputs": {}, "labels": []}, "'inputs' must be"),
        ("string-sample", {"inputs": {name: [["a"] * len(s)]}, "labels": [1]}, "only numbers"),
        ("string-label", {"inputs": {name: [s]}, "labels": ["cat"]}, "labels must be numbers"),
        ("overflow", {"inputs": {name: [[1e300] * len(s)]}, "labels": [1]}, "NaN or Inf"),
        ("not-object", [1], "JSON object"),
    ]
    for case_id, body, fragment in cases:
        r = http.post("/v1/samples", json=body)
        assert r.status_code == 400, (case_id, r.text)
        assert fragment in r.json()["error"], (case_id, r.text)
    # samples train: NaN and Infinity (which inference takes) stay refused here
    for token in (b"NaN", b"Infinity", b"-Infinity"):
        r = http.post("/v1/samples", content=b'{"inputs": {"x": [[' + token + b']]}, "labels": [1]}')
        assert r.status_code == 400 and "non-finite" in r.json()["error"], r.text


def test_unknown_route_and_method(http, api_node):
    r = http.get("/v2/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get(f"/v2/models/{api_node.model_name}/infer")
    assert r.status_code == 405


def test_nested_and_flat_data_agree(http, api_node, reference_infer):
    """OIP allows ``data`` flat or nested row-major: both decode to the same tensor."""
    import numpy as np

    spec = api_node.inputs[0]
    x = np.random.default_rng(5).standard_normal((3, spec.shape[1])).astype(np.float32)
    url = f"/v2/models/{api_node.model_name}/infer"
    outs = []
    for data in (x.ravel().tolist(), x.tolist()):
        r = http.post(url, json={"id": "n", "inputs": [{"name": spec.name, "shape": [3, spec.shape[1]],
                                                         "datatype": "FP32", "data": data}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "n" and body["model_name"] == api_node.model_name
        out = body["outputs"][0]
        assert out["datatype"] == "FP32" and out["shape"] == [3, api_node.outputs[0].shape[-1]]
        outs.append(np.asarray(out["data"], np.float32).reshape(out["shape"]))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], reference_infer(x)[api_node.outputs[0].name], atol=1e-5, rtol=0)
