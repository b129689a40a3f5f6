"""federation/bounds.py: the limits receivers enforce, checked through pydantic like the messages."""

from __future__ import annotations

import math

import pytest
from pydantic import TypeAdapter, ValidationError

from federation import bounds as b


def ok(tp, value):
    return TypeAdapter(tp).validate_python(value)


def bad(tp, value):
    with pytest.raises(ValidationError):
        TypeAdapter(tp).validate_python(value)


@pytest.mark.parametrize("value", ["node-1", "a", "A.b_c-9", "x" * 64])
def test_ids_accepted(value):
    assert ok(b.Id, value) == value and b.valid_id(value)


@pytest.mark.parametrize("value", ["", "-a", "a/b", "a+b", "#", "a b", "x" * 65, "<b>x</b>", "é"])
def test_ids_refused(value):
    bad(b.Id, value)
    assert not b.valid_id(value)
    with pytest.raises(b.OutOfBounds, match="invalid node id"):
        b.check_id(value, "node id")


def test_lr():
    assert ok(b.Lr, 0.1) == 0.1 and ok(b.Lr, b.LR_MAX) == b.LR_MAX
    for value in (0, -1, 1e30, math.inf, math.nan, b.LR_MAX * 1.01):
        bad(b.Lr, value)


def test_steps_local_steps_timeouts():
    assert ok(b.Steps, 1) == 1 and ok(b.LocalSteps, b.LOCAL_STEPS_MAX) == b.LOCAL_STEPS_MAX
    for tp, value in [(b.Steps, 0), (b.Steps, b.STEPS_MAX + 1), (b.LocalSteps, 0),
                      (b.LocalSteps, 1_000_000_000), (b.StepTimeout, 0), (b.StepTimeout, 1e9),
                      (b.StepTimeout, math.inf), (b.StepTimeout, math.nan)]:
        bad(tp, value)
    assert ok(b.StepTimeout, 30.0) == 30.0
    b.check_round(100, 10, 30.0)
    with pytest.raises(b.OutOfBounds, match="steps x local_steps"):
        b.check_round(b.STEPS_MAX, b.LOCAL_STEPS_MAX, 30.0)
    with pytest.raises(b.OutOfBounds, match="step_timeout_s"):
        b.check_round(1, 1, 1e9)


def test_participants():
    assert ok(b.Participants, ["a", "b"]) == ["a", "b"]
    bad(b.Participants, [])
    assert ok(b.Participants, ["a", "b", "a"]) == ["a", "b"]
    bad(b.Participants, ["a", "bad/id"])
    bad(b.Participants, [f"n{i}" for i in range(b.PARTICIPANTS_MAX + 1)])


def test_status_fields():
    for tp, good, wrong in [(b.HeartbeatS, 5.0, math.inf), (b.KeepaliveS, 10.0, math.inf),
                            (b.KeepaliveS, 10.0, 0.0), (b.HeartbeatS, 5.0, 1e9),
                            (b.ModelVersion, 3, -1), (b.ModelVersion, 3, 1_000_000_000_000_000_000),
                            (b.Samples, 10, -5), (b.Finite, 1.5, math.nan), (b.Finite, 1.5, -math.inf),
                            (b.Sha256Hex, "a" * 64, "A" * 64),
                            (b.Sha256Hex, "", "abc"), (b.Text, "rpi4", "x" * 5000),
                            (b.Url, "http://h:1", "h" * 300), (b.Reason, "timeout", 5)]:
        assert ok(tp, good) == good
        bad(tp, wrong)
    assert ok(b.Loss, None) is None and ok(b.Loss, 0.5) == 0.5
    assert ok(b.Loss, math.nan) is None and ok(b.Loss, -math.inf) is None  # reported as null
    assert ok(b.Reason, "r" * 600) == "r" * b.REASON_MAX  # a node's own long reason is cut


def test_finite_or_none():
    assert b.finite_or_none(1.0) == 1.0
    assert b.finite_or_none(math.nan) is None and b.finite_or_none(math.inf) is None
    assert b.finite_or_none(None) is None
