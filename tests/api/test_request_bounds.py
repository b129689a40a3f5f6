"""Every field of every request of the node API at and just past its declared range (issue 27):
never a 5xx. The cases come from the node's OpenAPI schema (``tests/boundcases.py``); the node's
``[training]`` table shares the round bounds with the fleet (tests/fleet/test_request_bounds.py)."""

from __future__ import annotations

from collections import Counter

from fastapi.testclient import TestClient

from api.node_app import create_node_app
from tests.boundcases import operation_cases


def test_every_node_request_field_over_its_bounds(api_node):
    app = create_node_app(api_node)
    cases = list(operation_cases(app.openapi()))
    labels = {f"{c.method} {c.path}" for c in cases}
    assert any(lbl.startswith("POST /v1/samples") for lbl in labels)
    assert any(lbl.endswith("/infer") for lbl in labels)
    codes: Counter = Counter()
    with TestClient(app) as client:
        for i, case in enumerate(cases):
            # Half the cases name the served model (the schema's name is "a"), so they reach the decoder.
            path = case.path.replace("/models/a/", f"/models/{api_node.model_name}/") if i % 2 else case.path
            headers = {"Content-Type": "application/json"} if case.has_body else {}
            r = client.request(case.method, path, params=case.query,
                               content=case.content() if case.has_body else None, headers=headers)
            assert r.status_code < 500, (case, r.status_code, r.text[:300])
            codes[r.status_code] += 1
    assert codes[400] and codes[404] and codes[200]
