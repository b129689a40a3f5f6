"""The ring-allreduce schedule as pure arithmetic: no I/O, no threads, no numpy.

Members are ranks ``0..n-1`` in ring order (the engine uses ``sorted(group)``). Rank ``r``
only ever sends to ``(r + 1) % n`` and receives from ``(r - 1) % n``. A vector of
``length`` elements is cut into ``n`` contiguous chunks (:func:`chunk_bounds`); chunk sizes
differ by at most one and some are empty when ``length < n``.

Reduce-scatter, steps ``s = 0 .. n-2``: rank ``r`` sends its partial sum of chunk
``(r - s) % n`` and receives, then adds its own values into, chunk ``(r - s - 1) % n``.
After the last step rank ``r`` holds the complete sum of chunk ``(r + 1) % n``
(:func:`owned_chunk`); each element was added exactly once per member.

All-gather, steps ``s = 0 .. n-2``: rank ``r`` sends chunk ``(r + 1 - s) % n`` (its own
final chunk at step 0, afterwards the one it received at step ``s - 1``) and receives chunk
``(r - s) % n``. The bytes the owner puts on the wire at step 0 are forwarded unchanged, so
every member (the owner too) ends with exactly the owner's bytes.

A chunk travels as one or more *parts* of at most ``per_part`` elements
(:func:`part_bounds`) so that a frame respects the transport's ``max_payload``; part ``p`` of
a chunk may be forwarded as soon as part ``p`` of the previous step has arrived.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Stage",
    "Transfer",
    "chunk_bounds",
    "part_bounds",
    "owned_chunk",
    "owner",
    "reduce_scatter",
    "all_gather",
    "plan",
    "successor",
    "predecessor",
    "chain",
]


class Stage(enum.IntEnum):
    """The two halves of a ring allreduce (values equal the wire ``Phase`` codes)."""

    REDUCE_SCATTER = 1
    ALL_GATHER = 2


@dataclass(frozen=True)
class Transfer:
    """What ``rank`` does at one step: send ``send_chunk`` to ``dst``, receive ``recv_chunk`` from ``src``."""

    stage: Stage
    step: int
    rank: int
    send_chunk: int
    recv_chunk: int
    dst: int
    src: int


def _check(n: int, rank: int | None = None) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"ring size must be a positive int, got {n!r}")
    if rank is not None and not 0 <= rank < n:
        raise ValueError(f"rank {rank} outside ring of {n}")


def chunk_bounds(n: int, length: int) -> list[tuple[int, int]]:
    """``n`` contiguous ``(start, stop)`` chunks covering ``range(length)``.

    The first ``length % n`` chunks get one element more; with ``length < n`` the last chunks
    are empty (``start == stop``). Every member computes the same bounds.
    """
    _check(n)
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    base, extra = divmod(length, n)
    bounds = []
    start = 0
    for c in range(n):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def part_bounds(start: int, stop: int, per_part: int, *, at_least_one: bool = False) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` into parts of at most ``per_part`` elements.

    An empty range has no parts unless ``at_least_one`` (the broadcast sends one empty frame
    so receivers learn the length).
    """
    if per_part < 1:
        raise ValueError(f"per_part must be >= 1, got {per_part}")
    if stop < start:
        raise ValueError(f"bad range [{start}, {stop})")
    parts = [(a, min(a + per_part, stop)) for a in range(start, stop, per_part)]
    if not parts and at_least_one:
        parts = [(start, start)]
    return parts


def successor(rank: int, n: int) -> int:
    return (rank + 1) % n


def predecessor(rank: int, n: int) -> int:
    return (rank - 1) % n


def owned_chunk(rank: int, n: int) -> int:
    """The chunk whose complete sum ``rank`` holds after reduce-scatter (and sends first in all-gather)."""
    _check(n, rank)
    return (rank + 1) % n


def owner(chunk: int, n: int) -> int:
    """The rank that owns (finishes reducing) ``chunk``."""
    _check(n, chunk)
    return (chunk - 1) % n


def reduce_scatter(n: int, rank: int) -> list[Transfer]:
    """The ``n - 1`` reduce-scatter transfers of ``rank`` (empty for ``n == 1``)."""
    _check(n, rank)
    dst, src = successor(rank, n), predecessor(rank, n)
    return [
        Transfer(Stage.REDUCE_SCATTER, s, rank, (rank - s) % n, (rank - s - 1) % n, dst, src)
        for s in range(n - 1)
    ]


def all_gather(n: int, rank: int) -> list[Transfer]:
    """The ``n - 1`` all-gather transfers of ``rank`` (empty for ``n == 1``)."""
    _check(n, rank)
    dst, src = successor(rank, n), predecessor(rank, n)
    return [Transfer(Stage.ALL_GATHER, s, rank, (rank + 1 - s) % n, (rank - s) % n, dst, src)
            for s in range(n - 1)]


def plan(n: int, rank: int) -> list[Transfer]:
    """Reduce-scatter then all-gather transfers of ``rank``: ``2 (n - 1)`` in all."""
    return reduce_scatter(n, rank) + all_gather(n, rank)


def chain(n: int, root: int) -> list[int]:
    """Broadcast order along the ring starting at ``root``: hop ``d`` is rank ``(root + d) % n``."""
    _check(n, root)
    return [(root + d) % n for d in range(n)]
