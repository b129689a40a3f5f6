"""Schemathesis fuzzes every operation of the node's OpenAPI schema: no input may cause a 5xx."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from api.node_app import create_node_app

MAX_EXAMPLES = 40


@pytest.fixture(scope="module")
def schema(api_node):
    return schemathesis.openapi.from_asgi("/openapi.json", create_node_app(api_node))


def test_no_server_errors(schema, api_node):
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.label for op in ops} >= {"POST /v2/models/{name}/infer", "POST /v1/samples", "GET /v1/node",
                                        "GET /v2/models/{name}", "GET /metrics"}
    seen: dict[str, set[int]] = {}
    for op in ops:
        _fuzz(op, api_node.model_name, seen)
    infer_codes = seen["POST /v2/models/{name}/infer"]
    assert 400 in infer_codes and 404 in infer_codes  # it did reach the decoder and the model check


def _fuzz(op, model_name: str, seen: dict[str, set[int]]) -> None:
    # Half of the cases use the served model's name so the fuzzer reaches the tensor decoder
    # instead of stopping at 404 for a random name.
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(), real_name=st.booleans())
    def run(case, real_name):
        if real_name and "name" in (case.path_parameters or {}):
            case.path_parameters["name"] = model_name
        response = case.call()
        seen.setdefault(op.label, set()).add(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    run()
