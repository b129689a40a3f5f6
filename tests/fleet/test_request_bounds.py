"""Every field of every request model of the fleet API at and just past its declared range (issue 27):
never a 5xx, and a round the API accepts is one every node accepts (issue 26 finding 12: lr 50,
10.0000001 and 100 answered 500 because the API and the signed command had different bounds).

The cases come from the fleet's OpenAPI schema (the pydantic models' field metadata,
``tests/boundcases.py``), so a new field or bound is driven without editing this file."""

from __future__ import annotations

from collections import Counter

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api.fleet.rounds import RoundRequest
from api.fleet.settings import FleetSettings
from api.fleet_app import create_fleet_app
from compiler.quantize import MODES
from edgenode.config import InferenceConfig, PrecisionSetting, TrainingConfig
from federation import topics
from federation.messages import InferenceInfo, NodeState, NodeStatus, Precision, RoundCommand, parse_command
from federation.roundspec import RoundSettings, resolve
from tests.boundcases import Case, boundary_values, operation_cases
from tests.fleet.fake_link import FakeLink

TOKEN = "bounds-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Served as files or streams, no fields to drive: the image upload (raw body), the event stream.
SKIP = {"POST /api/images", "GET /api/events"}


def _fleet(tmp_path, i: int):
    link = FakeLink()
    app = create_fleet_app(FleetSettings(swarm="bd", token=TOKEN, broker="mqtt://unused:1",
                                         db=str(tmp_path / f"f{i}.sqlite"), images_dir=str(tmp_path / "img")),
                           link_factory=lambda s: link)
    return app, link


def _send(client: TestClient, case: Case):
    headers = dict(AUTH)
    if case.has_body:
        headers["Content-Type"] = "application/json"
    return client.request(case.method, case.path, params=case.query, headers=headers,
                          content=case.content() if case.has_body else None)


def test_every_fleet_request_field_over_its_bounds(tmp_path):
    """Fresh fleet per case (two idle nodes a and b, so round and rollback requests get past the
    swarm checks to the command they build): no 5xx; every accepted round's signed command parses
    and resolves against a node's defaults."""
    app0, _ = _fleet(tmp_path, 0)
    cases = list(operation_cases(app0.openapi(), SKIP))
    rounds = [c for c in cases if (c.method, c.path) == ("POST", "/api/rounds")]
    lrs = {c.value for c in rounds if c.where == "body.lr" and isinstance(c.value, float)}
    assert {50.0, 10.0000001, 100.0} <= lrs  # issue 26 finding 12's requests are among the derived ones
    codes: dict[str, Counter] = {}
    fleet = None
    for i, case in enumerate(cases):
        if fleet is None:  # a fresh fleet after every request that changed its state
            app, link = _fleet(tmp_path, i)
            fleet = TestClient(app).__enter__()
            for n in ("a", "b"):
                link.deliver(topics.status("bd", n), NodeStatus(
                    node_id=n, state=NodeState.ONLINE, model_version=2, versions=[0, 1, 2], samples_val=10,
                    params_sha256="ab" * 32).model_dump_json().encode())
        r = _send(fleet, case)
        assert r.status_code < 500, (case, r.status_code, r.text[:300])
        codes.setdefault(f"{case.method} {case.path.split('/')[2]}", Counter())[r.status_code] += 1
        if (case.method, case.path) == ("POST", "/api/rounds"):
            if case.where == "body.lr" and case.value in (50.0, 10.0000001, 100.0):
                assert r.status_code == 422 and "10" in r.text, r.text
            if r.status_code == 201:
                cmds = [parse_command(p) for t, p in link.published if t == topics.command("bd")]
                assert len(cmds) == 1 and isinstance(cmds[0], RoundCommand)
                resolve(cmds[0], TrainingConfig())  # every node accepts and resolves it
        # a new enrolment token changes nothing another case depends on: no fresh fleet for it
        if case.method != "GET" and r.status_code < 300 and case.path != "/api/enrollment-tokens":
            fleet.__exit__(None, None, None)
            fleet = None
    if fleet is not None:
        fleet.__exit__(None, None, None)
    assert codes["POST rounds"][201] and codes["POST rounds"][422]
    assert codes["POST rollback"][202] and codes["POST rollback"][422]


@pytest.mark.parametrize("name", sorted(RoundSettings.model_fields))
def test_round_settings_agree_across_api_command_and_node_config(name):
    """Each round setting has one bound: the API request, the signed command and the node's
    [training] table accept exactly the same values (a value the API accepts, every node accepts)."""
    schema = RoundRequest.model_json_schema()
    values = boundary_values(schema["properties"][name], schema.get("$defs", {}))
    assert len(values) >= 6
    for v in values:
        if not isinstance(v, (int, float, str)) or isinstance(v, bool):
            continue
        verdicts = []
        for model, fixed in ((RoundRequest, {"steps": 1}),
                             (RoundCommand, {"round_id": "r1", "steps": 1, "participants": ["a", "b"]}),
                             (TrainingConfig, {})):
            try:
                model.model_validate(fixed | {name: v})
                verdicts.append(True)
            except ValidationError:
                verdicts.append(False)
        if (name, v) == ("sync", "async"):
            # the node's own mode (PROTOCOL.md section 13), never a round's: API and command refuse it
            assert verdicts == [False, False, True], verdicts
            continue
        assert len(set(verdicts)) == 1, (name, v, verdicts)


def test_fleet_settings_forwarded_to_commands_share_their_bounds():
    """The fleet's step_timeout_s goes into every RoundCommand and max_steps caps its steps: a
    setting the command cannot carry fails when the fleet starts, not as a 500 on every round."""
    for v in (0.1, 300, 300.5, 0.05, 1e9):
        verdicts = []
        for build in (lambda: FleetSettings(step_timeout_s=v),  # noqa: B023 - called at once
                      lambda: RoundCommand(round_id="r1", steps=1, participants=["a"], step_timeout_s=v)):  # noqa: B023
            try:
                build()
                verdicts.append(True)
            except ValidationError:
                verdicts.append(False)
        assert len(set(verdicts)) == 1, (v, verdicts)
    with pytest.raises(ValidationError):
        FleetSettings(max_steps=100_001)


def test_inference_precision_agrees_across_config_status_and_compiler():
    """[inference] precision: a value the node's config accepts is one its status reports (auto
    resolves to one of them) and, besides float, a mode `fractal compile --quantize` builds."""
    for v in PrecisionSetting:
        InferenceConfig.model_validate({"precision": v.value})
        if v != PrecisionSetting.AUTO:
            info = InferenceInfo(precision=Precision(v.value))
            NodeStatus(node_id="a", state=NodeState.ONLINE, inference=info)
            assert v == PrecisionSetting.FLOAT or v.value in MODES
    assert {p.value for p in Precision} == {v.value for v in PrecisionSetting} - {"auto"}
    with pytest.raises(ValidationError):
        InferenceConfig.model_validate({"precision": "int4"})
