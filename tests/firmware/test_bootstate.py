"""The slot state machine (firmware/bootstate.py): the table of transitions is enforced, and the
typed state reads and writes the same boot-state.json (format 1) as before."""

from __future__ import annotations

import json

import pytest

from firmware.bootstate import TRANSITIONS, BadTransition, BootState, Health, SlotRecord, SlotState


def test_only_the_transitions_of_the_table_are_allowed():
    for old in SlotState:
        for new in SlotState:
            st = BootState(board="x86_64", arch="x86_64")
            st.slots["a"] = SlotRecord(old)
            if new in TRANSITIONS[old]:
                st.set_slot_state("a", new)
                assert st.slot("a").state is new
            else:
                with pytest.raises(BadTransition):
                    st.set_slot_state("a", new)
    assert SlotState.GOOD not in TRANSITIONS[SlotState.BAD]  # a bad slot never boots again unflashed
    assert SlotState.TRIAL not in TRANSITIONS[SlotState.EMPTY]  # nothing boots before it was written


def test_a_flash_a_pass_a_failure_and_a_halt():
    st = BootState(board="x86_64", arch="x86_64")
    st.begin_write("a")
    st.switch_to_trial("a", SlotRecord(SlotState.TRIAL, "1.0.0", 1, "k", "m", "x86_64", ["PEM"]), trials=2)
    st.start("a")
    assert (st.active, st.booted, st.trials_left, st.health) == ("a", "a", 1, Health.PENDING)
    assert st.passed("a") == ["PEM"] and st.rollback_floor == 1 and st.slot("a").state is SlotState.GOOD
    st.keys_trusted("a")
    st.begin_write("b")
    st.switch_to_trial("b", SlotRecord(SlotState.TRIAL, "2.0.0", 5, "k", "m", "x86_64", ["PEM2"]), trials=3)
    assert (st.active, st.previous) == ("b", "a")
    assert st.fall_back("b", "boom") == "a"
    assert st.slot("b").pending_keys == [] and st.slot("b").problem == "boom" and st.rollback_floor == 1
    assert st.fall_back("a", "gone") is None and st.active is None
    st.halted("nothing left")
    back = BootState.from_json(json.loads(json.dumps(st.to_json())))
    assert back == st and back.to_json()["halt"] == "nothing left"


@pytest.mark.parametrize("junk", [
    {}, {"format_version": 2}, {"format_version": 1, "board": "x", "arch": "y", "slots": {"a": {}}},
    {"format_version": 1, "board": "x", "arch": "y", "active": "c",
     "slots": {"a": {"state": "good"}, "b": {"state": "empty"}}},
    {"format_version": 1, "board": "x", "arch": "y",
     "slots": {"a": {"state": "sideways"}, "b": {"state": "empty"}}},
])
def test_a_damaged_state_is_refused(junk):
    with pytest.raises((ValueError, KeyError, TypeError)):
        BootState.from_json(junk)
