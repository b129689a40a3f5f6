"""`make soak` in miniature (harness/soak.py): a signed 3-node swarm on the namespaced network doing
rounds for ~20 s while nodes are SIGKILLed and restarted and junk and well-formed forgeries are
injected (unsigned aborts and failure events, an abort signed by a key the keyring does not hold,
replays of genuine signed commands and events): no round fails because of a forgery, the
forgeries are dropped and counted per reason, and every node ends on the same parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.mosquitto]


def test_signed_soak_drops_every_forgery_and_ends_in_agreement(digits_artifact: Path) -> None:
    from harness.soak import soak

    r = soak(digits_artifact, minutes=0.35, nodes=3, seed=3, hostile=True, steps=3)
    assert r["signed"]
    assert r["final_round"]["state"] == "done", r["final_round"]
    assert r["params_agree_at_end"], r["params_at_end"]
    reasons = r["rounds"]["failure_reasons"]
    # only kills (and the splits they leave behind) may fail rounds, never a forgery
    assert not [w for w in reasons if "forgery" in w or "by the fleet" in w], reasons
    assert r["rounds"].get("done", 0) >= 5, r["rounds"]
    inj, nodes, fleet = r["injected"], r["messages_dropped_by_nodes"], r["messages_dropped_by_fleet"]
    assert inj.get("forged-abort", 0) + inj.get("forged-failed-event", 0) > 0, inj
    assert nodes.get("unsigned", 0) > 0, nodes
    if inj.get("rogue-signed-abort"):
        assert nodes.get("unknown_key", 0) > 0, nodes
    if inj.get("replayed-cmd"):
        assert nodes.get("replayed", 0) + nodes.get("stale", 0) > 0, nodes
    if inj.get("replayed-event") or inj.get("forged-failed-event"):
        assert fleet["total"] > 0, fleet
    assert r["commands_rejected_by_nodes"] == 0  # nothing unsigned got as far as the command parser
