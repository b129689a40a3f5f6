"""Payload formats of sensor streams -> readings ``(t, {channel: value})``: pure, no I/O.

- ``senml``: a SenML JSON pack (RFC 8428): an array of records; ``bn``/``bt``/``bv`` base fields
  apply to the records after them, the name is ``bn + n``, the time ``bt + t`` (absent: base time;
  below 2**28 it is relative to now, RFC 8428 4.5.3), the value ``bv + v``. Records with the same
  time make one reading over their channels.
- ``json``: one object ``{"t": time, FIELD: number, ...}`` or an array of them (the time field is
  configurable; absent = arrival time).
- ``f32``: raw little-endian float32 frames: ``n x channels`` values, channel-interleaved, the
  rows consecutive at the stream's sample rate (:class:`FrameClock` dates them).

Parsing never raises: a bad payload or record is counted (``malformed``), names that map to no
channel are counted (``unmapped``), the rest is returned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Parsed", "parse_senml", "parse_json", "parse_f32", "FrameClock", "SENML_RELATIVE"]

SENML_RELATIVE = 2.0**28  # RFC 8428: a resolved time below this is relative to now


@dataclass
class Parsed:
    """Readings of one payload in payload order, and what was dropped while parsing."""

    readings: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    malformed: int = 0
    unmapped: int = 0


def _num(v: object) -> float | None:
    """A finite JSON number as float, else None (bool is not a number here)."""
    t = type(v)
    if t is float:
        return v if v - v == 0.0 else None  # type: ignore[operator,return-value]  # inf/nan: nan
    if t is int:
        try:
            return float(v)  # type: ignore[arg-type]
        except OverflowError:  # a 400-digit JSON integer
            return None
    return None


def _loads(payload: bytes) -> object:
    try:
        return json.loads(payload, parse_constant=lambda c: None)  # NaN/Infinity -> None -> malformed
    except (ValueError, RecursionError):
        return None


def parse_senml(payload: bytes, channels: Mapping[str, int], now: float) -> Parsed:
    """Readings of a SenML JSON pack; ``channels`` maps resolved names to channel indices."""
    out = Parsed()
    pack = _loads(payload)
    if not isinstance(pack, list) or not pack:
        out.malformed += 1
        return out
    bn, bt, bv = "", 0.0, 0.0
    by_time: dict[float, dict[int, float]] = {}
    for rec in pack:
        if not isinstance(rec, dict):
            out.malformed += 1
            continue
        if "bn" in rec:
            if not isinstance(rec["bn"], str):
                out.malformed += 1
                continue
            bn = rec["bn"]
        if "bt" in rec or "bv" in rec:
            base_t, base_v = _num(rec.get("bt", bt)), _num(rec.get("bv", bv))
            if base_t is None or base_v is None:
                out.malformed += 1
                continue
            bt, bv = base_t, base_v
        name = rec.get("n", "")
        if not isinstance(name, str):
            out.malformed += 1
            continue
        if not any(k in rec for k in ("v", "vs", "vb", "vd", "s")):
            continue  # a record carrying only base fields
        ch = channels.get(bn + name)
        if ch is None:
            out.unmapped += 1
            continue
        v, t = _num(rec.get("v")), (_num(rec["t"]) if "t" in rec else 0.0)
        if v is None or t is None:
            out.malformed += 1
            continue
        when = bt + t
        if when < SENML_RELATIVE:
            when += now
        by_time.setdefault(when, {})[ch] = bv + v
    out.readings = list(by_time.items())
    return out


def parse_json(payload: bytes, channels: Mapping[str, int], now: float, time_field: str = "t") -> Parsed:
    """Readings of a flat JSON object (or an array of them) with named fields."""
    out = Parsed()
    doc = _loads(payload)
    objs = doc if isinstance(doc, list) else [doc]
    if not objs:
        out.malformed += 1
    for obj in objs:
        if not isinstance(obj, dict):
            out.malformed += 1
            continue
        t = _num(obj[time_field]) if time_field in obj else now
        values: dict[int, float] = {}
        bad = t is None
        for k, raw in obj.items():
            if k == time_field:
                continue
            ch = channels.get(k)
            if ch is None:
                out.unmapped += 1
                continue
            v = _num(raw)
            if v is None:
                bad = True
                break
            values[ch] = v
        if bad or t is None:
            out.malformed += 1
        elif values:
            out.readings.append((t, values))
    return out


def parse_f32(payload: bytes, channels: int) -> np.ndarray | None:
    """Rows (n, channels) of a raw little-endian float32 frame; None if the size does not fit or a
    value is not finite."""
    if not payload or len(payload) % (4 * channels):
        return None
    rows = np.frombuffer(payload, dtype="<f4").reshape(-1, channels)
    if not np.isfinite(rows).all():
        return None
    return rows.astype(np.float32)


class FrameClock:
    """Dates raw frames, which carry no time: a frame continues the previous one unless it
    arrives more than ``tolerance_s`` after the previous frame's rows would have ended."""

    def __init__(self, rate_hz: float, tolerance_s: float) -> None:
        self.rate_hz = rate_hz
        self.tolerance_s = tolerance_s
        self._next: float | None = None  # time of the row after the last frame

    def start_of(self, rows: int, arrival: float) -> float:
        """Time of the first row of a frame of ``rows`` rows that arrived at ``arrival``."""
        duration = rows / self.rate_hz
        nxt = self._next
        t0 = nxt if nxt is not None and arrival - (nxt + duration) <= self.tolerance_s \
            else arrival - duration
        self._next = t0 + duration
        return t0
