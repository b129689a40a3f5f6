"""The start-version rule: which parameters a round starts from (pure).

Never "the highest version claimed": a member can claim any version (issue 12: one rogue
member with ``model_version: 1000000`` replaced the model of the whole swarm). Instead:

1. the parameters held by a strict majority of the participants;
2. else, if the fleet knows the parameters its last committed round produced and a participant
   holds them, those (a fresh member joining a swarm of one is outvoted by history, not by
   a claim);
3. else none: the round is refused and the operator picks the participants.

The fleet applies the rule when it starts a round and puts the answer, signed, in the
RoundCommand (``start_sha256``); members start from whoever holds that hash. Members of a
round without it (an older fleet) apply rule 1 to the hashes exchanged in the hello.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

__all__ = ["start_hash"]


def start_hash(holdings: Mapping[str, str], *, last_committed: str | None = None) -> str | None:
    """``holdings``: member -> params_sha256 (empty = unknown). Returns the hash to start from,
    or None when the rule cannot decide."""
    counts = Counter(h for h in holdings.values() if h)
    if not counts:
        return None
    best, n = counts.most_common(1)[0]
    if 2 * n > len(holdings):
        return best
    if last_committed and last_committed in counts:
        return last_committed
    return None
