"""The start-version rule: majority, then the fleet's last committed hash, never the highest claim."""

from federation.startversion import start_hash

A, B, C = "a" * 64, "b" * 64, "c" * 64


def test_majority_wins_whatever_versions_are_claimed():
    assert start_hash({"n1": A, "n2": A, "evil": B}) == A
    assert start_hash({"n1": A, "n2": A, "n3": A}) == A


def test_tie_is_broken_by_the_last_committed_round_only():
    assert start_hash({"old": A, "fresh": B}, last_committed=A) == A
    assert start_hash({"old": A, "evil": B}, last_committed=None) is None
    assert start_hash({"a": A, "b": B, "c": C, "d": C}, last_committed=A) == A
    assert start_hash({"a": A, "b": B}, last_committed=C) is None


def test_unknown_hashes_do_not_count():
    assert start_hash({"n1": "", "n2": ""}) is None
    assert start_hash({"n1": A, "n2": "", "n3": A}) == A
