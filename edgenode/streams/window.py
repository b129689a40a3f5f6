"""Readings on a sample-rate grid -> fixed-length windows: pure, no I/O, bounded.

A stream has ``channels`` channels sampled at ``rate_hz``. A reading is a time (seconds) and values
for some of the channels; its *slot* is ``round(t * rate_hz)``. A slot is *final* once the newest
slot seen is ``delay`` slots past it (``delay = 0``: at once): until then a reading may still
arrive out of order and fill it. Final slots form the current *segment*; every ``hop`` slots the
newest ``length`` slots of the segment are emitted as a window (``length`` x ``channels``,
optionally normalised per channel).

Reading outcomes (:class:`Outcome`, counted by the caller per stream):

- ``accepted``: placed in its slot (in order).
- ``out_of_order``: older than the newest slot but not final yet: placed, counted apart.
- ``late``: its slot is already final (or before the segment): dropped.
- ``duplicate``: its slot already holds a value for every channel it carries: dropped.
- ``malformed``: a time or value that is not a finite number, or a channel out of range: dropped.

Gaps: a channel missing in a final slot holds its previous value, for at most ``gap_slots``
consecutive slots. A longer hole (seen as its slots become final, or at once when a reading
lands more than ``gap_slots + delay + 1`` slots after the newest)
ends the segment: the partial window is discarded, never stitched across the gap, and the next
window starts after the gap (counted in :attr:`Windower.gaps`).

Bounds: at most ``delay + 1`` open slots and ``length`` final rows are held, whatever the readings.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["Outcome", "WindowSpec", "Windower", "Window", "spectrum"]


class Outcome(enum.StrEnum):
    ACCEPTED = "accepted"
    OUT_OF_ORDER = "out_of_order"
    LATE = "late"
    DUPLICATE = "duplicate"
    MALFORMED = "malformed"


@dataclass(frozen=True)
class WindowSpec:
    """The window of one stream (see the module docstring)."""

    channels: int
    rate_hz: float
    length: int
    hop: int
    gap_slots: int = 0
    delay: int = 0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.channels < 1 or self.length < 1 or self.hop < 1 or self.gap_slots < 0 or self.delay < 0:
            raise ValueError("channels, length and hop must be >= 1; gap_slots and delay >= 0")
        if not (math.isfinite(self.rate_hz) and self.rate_hz > 0):
            raise ValueError("rate_hz must be a positive number")
        for name, v in (("mean", self.mean), ("std", self.std)):
            if v is not None and len(v) != self.channels:
                raise ValueError(f"{name} needs one value per channel ({self.channels})")
        if self.std is not None and not all(s > 0 for s in self.std):
            raise ValueError("std values must be > 0")


@dataclass(frozen=True)
class Window:
    """One emitted window: ``values`` (length, channels) float32 and the time of its first slot."""

    values: np.ndarray
    start_s: float
    end_s: float


def spectrum(values: np.ndarray) -> np.ndarray:
    """Amplitude spectrum per channel of a window (length, channels) -> (length // 2, channels):
    Hann-windowed, without the DC bin, scaled so a sine of amplitude A shows as ~A at its bin."""
    n = values.shape[0]
    hann = np.hanning(n)[:, None] if n > 1 else np.ones((1, 1))
    amp = np.abs(np.fft.rfft(np.asarray(values, np.float64) * hann, axis=0)) * (2.0 / hann.sum())
    return amp[1:n // 2 + 1].astype(np.float32)


class Windower:
    """Turns readings into windows. Not thread-safe: one per stream, fed by one thread."""

    def __init__(self, spec: WindowSpec) -> None:
        self.spec = spec
        self.gaps = 0  # segments ended by a gap longer than the tolerance
        self._open: dict[int, np.ndarray] = {}  # slot -> values (NaN = not received yet)
        self._head: int | None = None  # newest slot holding a value
        self._frontier: int | None = None  # first slot that is not final yet
        self._rows: deque[np.ndarray] = deque(maxlen=spec.length)  # final rows of the segment
        self._row_end: int = 0  # slot after the newest final row
        self._since_emit = 0  # final rows since the last window (emit when it reaches hop)
        self._emitted = False  # a window came out of this segment already
        self._last: np.ndarray | None = None  # last value per channel (NaN: none in this segment)
        self._missing = np.zeros(spec.channels, np.int64)  # consecutive held slots per channel
        self._mean = None if spec.mean is None else np.asarray(spec.mean, np.float32)
        self._std = None if spec.std is None else np.asarray(spec.std, np.float32)

    @property
    def held_slots(self) -> int:
        """Open slots plus final rows held now (bounded by ``delay + 1 + length``)."""
        return len(self._open) + len(self._rows)

    def push(self, t: float, values: Mapping[int, float]) -> tuple[Outcome, list[Window]]:
        """One reading: channel index -> value at time ``t`` (s). Returns its outcome and the
        windows it completed."""
        spec = self.spec
        try:
            tf = float(t)
            vals = {int(c): float(v) for c, v in values.items()}
        except (TypeError, ValueError, OverflowError):
            return Outcome.MALFORMED, []
        if not values or not math.isfinite(tf) or any(not math.isfinite(v) for v in vals.values()) \
                or any(not 0 <= c < spec.channels for c in vals):
            return Outcome.MALFORMED, []
        slot_f = tf * spec.rate_hz
        if not abs(slot_f) < 2**62:
            return Outcome.MALFORMED, []
        slot = int(round(slot_f))
        windows: list[Window] = []
        if self._head is None or slot - self._head > spec.gap_slots + spec.delay + 1:
            if self._head is not None:  # a hole longer than the tolerance: a new segment
                windows += self._finalize_to(self._head + 1)
                self._end_segment()
            self._frontier, self._head = slot, slot
        assert self._frontier is not None
        if slot < self._frontier:
            return Outcome.LATE, windows
        row = self._open.get(slot)
        if row is None:
            row = self._open[slot] = np.full(spec.channels, np.nan, np.float32)
        fresh = [c for c in vals if math.isnan(row[c])]
        if not fresh:
            return Outcome.DUPLICATE, windows
        for c in fresh:
            row[c] = vals[c]
        outcome = Outcome.OUT_OF_ORDER if slot < self._head else Outcome.ACCEPTED
        self._head = max(self._head, slot)
        windows += self._finalize_to(self._head - spec.delay + 1)
        return outcome, windows

    def push_block(self, t0: float, block: np.ndarray) -> tuple[int, list[Window]]:
        """Consecutive rows (n, channels) starting at time ``t0``, one slot each; returns how
        many rows were accepted (in order or out of order) and the windows completed."""
        arr = np.asarray(block, np.float64)
        if arr.ndim != 2 or arr.shape[1] != self.spec.channels:
            return 0, []
        ok, windows = 0, []
        for i, r in enumerate(arr):
            out, w = self.push(t0 + i / self.spec.rate_hz, dict(enumerate(r.tolist())))
            ok += out in (Outcome.ACCEPTED, Outcome.OUT_OF_ORDER)
            windows += w
        return ok, windows

    def flush(self) -> list[Window]:
        """Finalize every open slot (e.g. at shutdown): windows they complete; never a partial one."""
        if self._head is None:
            return []
        return self._finalize_to(self._head + 1)

    def _end_segment(self) -> None:
        self.gaps += 1
        self._rows.clear()
        self._since_emit = 0
        self._emitted = False
        self._last = None
        self._missing[:] = 0

    def _finalize_to(self, end: int) -> list[Window]:
        """Make every slot before ``end`` final, in order; returns the windows completed."""
        windows: list[Window] = []
        assert self._frontier is not None
        spec = self.spec
        while self._frontier < end:
            s = self._frontier
            self._frontier += 1
            row = self._open.pop(s, None)
            if row is None:
                row = np.full(spec.channels, np.nan, np.float32)
            hole = np.isnan(row)
            if not hole.any() and self._last is not None:  # the common case: a whole row
                self._missing[:] = 0
                self._last = row
            elif self._last is None:
                if hole.any():  # a segment starts at a slot holding every channel
                    continue
                self._last = row.copy()
            else:
                self._missing = np.where(hole, self._missing + 1, 0)
                if (self._missing > spec.gap_slots).any():  # a hole longer than the tolerance
                    self._end_segment()
                    if not hole.any():
                        self._last = row.copy()
                    else:
                        continue
                else:
                    row = np.where(hole, self._last, row).astype(np.float32)
                    self._last = row
            self._rows.append(row)
            self._row_end = s + 1
            self._since_emit += 1
            first = not self._emitted and len(self._rows) == spec.length
            if first or (self._emitted and self._since_emit >= spec.hop):
                windows.append(self._emit())
        return windows

    def _emit(self) -> Window:
        self._since_emit = 0
        self._emitted = True
        v = np.stack(list(self._rows)).astype(np.float32)
        if self._mean is not None:
            v = v - self._mean
        if self._std is not None:
            v = v / self._std
        start = self._row_end - self.spec.length
        return Window(values=v, start_s=start / self.spec.rate_hz, end_s=self._row_end / self.spec.rate_hz)
