"""How a round trains: its sync mode and its update compression, as plain enums.

Part of a round's settings (:mod:`federation.roundspec`, which re-exports them, as do the
messages); a module of their own so that the training worker (edgenode/trainworker.py) and the
ring's codecs use them without loading the message models and pydantic (issue 25: a board's
memory).
"""

from __future__ import annotations

import enum

__all__ = ["SyncMode", "Compression"]


class SyncMode(enum.StrEnum):
    GRADIENT = "gradient"  # allreduce gradients every step (synchronous SGD)
    LOCAL_SGD = "local-sgd"  # k local steps, then average the parameter deltas
    # No rounds: buffered asynchronous aggregation by the fleet (PROTOCOL.md section 13). A node
    # setting only ([training] sync); a round command cannot ask for it.
    ASYNC = "async"


class Compression(enum.StrEnum):
    NONE = "none"
    FP16 = "fp16"
    INT8 = "int8"  # with error feedback
    TOPK = "topk"  # with error feedback
