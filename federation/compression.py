"""Payload codecs of DATA frames, with optional error feedback, and their error bounds.

Payload byte layouts (little-endian), for a part of ``count`` float32 elements:

    codec  layout                                               bytes
    -----  ---------------------------------------------------  ------------
    F32    count x float32                                      4 * count
    F16    count x IEEE half (values clipped to +-65504)        2 * count
    INT8   float32 scale s, then count x int8 q; value = q * s  4 + count
    TOPK   u32 k, k x u32 index (strictly increasing, < count),  4 + 8 * k
           k x float32 value; other elements are 0

Error per transmitted value x (before error feedback):
* F32: none.
* F16: |x - fp16(x)| <= 2**-11 * |x| for 2**-14 <= |x| <= 65504, <= 2**-25 below (subnormal
  spacing), values beyond 65504 saturate (clipped instead of becoming inf).
* INT8: s = max|x| / 127 per part, |x - q s| <= s / 2 = max|x| / 254.
* TOPK: the k = ceil(ratio * count) largest |x| are exact, the rest become 0.

Error feedback (used by the ring for INT8 and TOPK): each member keeps a residual ``e`` per
element it transmits; it sends ``C(x + e)`` and keeps ``e <- x + e - D(C(x + e))``. In the ring
every element of the result is ``exact + sum over transmitting members (e_old - e_new)``, so
over T rounds with the same group the *accumulated* error telescopes to
``sum (e_0 - e_T)``: it stays bounded by one round's quantisation error instead of growing
with T, and top-k eventually transmits every coordinate.

Allreduce bound without feedback (F16): a ring result passes through n roundings (n - 1
reduce-scatter hops and one all-gather), so ``|sum_result - sum| <= n * 2**-11 * sum_i |x_i|``
(plus subnormal terms); ``mean`` divides both sides by n.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from federation.errors import FrameError
from federation.framing import MAX_OVERHEAD, Codec
from federation.modes import Compression

__all__ = [
    "Codec",
    "FEEDBACK_CODECS",
    "encode_nonfinite",
    "join_pieces",
    "codec_for",
    "per_part",
    "encode",
    "decode",
    "decode_add",
    "F16_MAX",
]

F16_MAX = 65504.0
FEEDBACK_CODECS = frozenset({Codec.INT8, Codec.TOPK})
_U32 = struct.Struct("<I")
_F32 = struct.Struct("<f")
_CODEC_SLACK = 16  # codec headers (scale, k) plus the +1 of ceil() in top-k


def codec_for(compression: Compression | str | Codec) -> Codec:
    """Map a :class:`Compression` (or its string value) to the wire codec."""
    if isinstance(compression, Codec):
        return compression
    try:
        c = Compression(compression)
    except ValueError as e:
        raise ValueError(
            f"unknown compression {compression!r}: use one of {[m.value for m in Compression]}"
        ) from e
    return {Compression.NONE: Codec.F32, Compression.FP16: Codec.F16, Compression.INT8: Codec.INT8,
            Compression.TOPK: Codec.TOPK}[c]


def per_part(codec: Codec, max_payload: int, topk_ratio: float = 0.01) -> int:
    """Elements per part so that any frame of this codec fits in ``max_payload`` bytes.

    Every member must use the same ``max_payload`` so that part layouts agree.
    """
    avail = max_payload - MAX_OVERHEAD - _CODEC_SLACK
    if avail < 64:
        raise ValueError(f"max_payload {max_payload} too small (need > {MAX_OVERHEAD + _CODEC_SLACK + 64})")
    if codec == Codec.F32:
        return avail // 4
    if codec == Codec.F16:
        return avail // 2
    if codec == Codec.INT8:
        return avail
    if codec == Codec.TOPK:
        _check_ratio(topk_ratio)
        return max(1, int(avail / (8 * topk_ratio)))
    raise ValueError(f"unknown codec {codec!r}")


def _check_ratio(ratio: float) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"topk_ratio must be in (0, 1], got {ratio}")


def _topk_k(count: int, ratio: float) -> int:
    return 0 if count == 0 else min(count, max(1, math.ceil(ratio * count)))


def _raw_encode(codec: Codec, v: np.ndarray, topk_ratio: float) -> list:
    if codec == Codec.F32:
        return [v]
    if codec == Codec.F16:
        return [np.clip(v, -F16_MAX, F16_MAX).astype("<f2")]
    if codec == Codec.INT8:
        amax = float(np.max(np.abs(v))) if v.size else 0.0
        scale = np.float32(amax / 127.0)
        if scale == 0 or not np.isfinite(scale):
            return [_F32.pack(0.0), np.zeros(v.size, np.int8)]
        q = np.clip(np.rint(v / scale), -127, 127).astype(np.int8)
        return [_F32.pack(float(scale)), q]
    if codec == Codec.TOPK:
        k = _topk_k(v.size, topk_ratio)
        if k == v.size:
            idx = np.arange(v.size, dtype="<u4")
        else:
            idx = np.sort(np.argpartition(np.abs(v), v.size - k)[v.size - k :]).astype("<u4")
        return [_U32.pack(k), idx, np.ascontiguousarray(v[idx], dtype="<f4")]
    raise ValueError(f"unknown codec {codec!r}")


def join_pieces(pieces: list) -> bytes:
    """The payload bytes of :func:`encode`'s pieces, in one buffer (what a receiver decodes)."""
    return b"".join(memoryview(p).cast("B") for p in pieces)


def encode_nonfinite(codec: Codec, count: int) -> list:
    """Pieces that decode to ``count`` elements, not all finite: how a non-finite vector is carried
    by a codec that would otherwise hide it (int8 turns a non-finite scale into zeros), so that
    every receiver sees it for what it is."""
    if codec == Codec.F32:
        return [np.full(count, np.nan, np.float32)]
    if codec == Codec.F16:
        return [np.full(count, np.nan, "<f2")]
    if codec == Codec.INT8:
        return [_F32.pack(float("nan")), np.zeros(count, np.int8)]
    if codec == Codec.TOPK:
        k = min(1, count)
        return [_U32.pack(k), np.zeros(k, "<u4"), np.full(k, np.nan, "<f4")]
    raise ValueError(f"unknown codec {codec!r}")


def encode(codec: Codec, values: np.ndarray, residual: np.ndarray | None = None, *,
           topk_ratio: float = 0.01) -> list:
    """Encode float32 ``values`` into payload pieces (bytes-like, for :func:`framing.encode`).

    With ``residual`` (same shape, float32) error feedback is applied: ``values + residual`` is
    encoded and ``residual`` is updated in place to what was not transmitted.
    """
    if codec == Codec.TOPK:
        _check_ratio(topk_ratio)
    if residual is None:
        return _raw_encode(codec, np.ascontiguousarray(values, dtype=np.float32), topk_ratio)
    v = values + residual
    pieces = _raw_encode(codec, v, topk_ratio)
    # The decoded value is what every receiver reconstructs: keep exactly the difference.
    np.subtract(v, decode(codec, join_pieces(pieces), v.size), out=residual)
    return pieces


def _view(payload, dtype: str, offset: int, count: int) -> np.ndarray:
    return np.frombuffer(payload, dtype=dtype, count=count, offset=offset)


def _check_len(codec: Codec, payload, count: int) -> int:
    n = len(payload)
    if codec == Codec.F32:
        want = 4 * count
    elif codec == Codec.F16:
        want = 2 * count
    elif codec == Codec.INT8:
        want = 4 + count
    elif codec == Codec.TOPK:
        if n < 4:
            raise FrameError("top-k payload shorter than its header")
        (k,) = _U32.unpack_from(payload, 0)
        if k > count:
            raise FrameError(f"top-k payload with k={k} > count={count}")
        want = 4 + 8 * k
    else:
        raise FrameError(f"unknown codec {codec!r}")
    if n != want:
        raise FrameError(f"{codec.name} payload of {n} bytes for {count} elements (expected {want})")
    return want


def _topk_parts(payload, count: int) -> tuple[np.ndarray, np.ndarray]:
    (k,) = _U32.unpack_from(payload, 0)
    idx = _view(payload, "<u4", 4, k)
    vals = _view(payload, "<f4", 4 + 4 * k, k)
    if k and (int(idx[-1]) >= count or (k > 1 and not bool(np.all(idx[1:] > idx[:-1])))):
        raise FrameError("top-k indices out of range or not strictly increasing")
    return idx, vals


def decode(codec: Codec, payload, count: int) -> np.ndarray:
    """Decode a payload of ``count`` elements to float32 (read-only view for F32)."""
    _check_len(codec, payload, count)
    if codec == Codec.F32:
        return _view(payload, "<f4", 0, count)
    if codec == Codec.F16:
        return _view(payload, "<f2", 0, count).astype(np.float32)
    if codec == Codec.INT8:
        (scale,) = _F32.unpack_from(payload, 0)
        return _view(payload, "i1", 4, count).astype(np.float32) * np.float32(scale)
    idx, vals = _topk_parts(payload, count)
    out = np.zeros(count, np.float32)
    out[idx] = vals
    return out


def decode_add(codec: Codec, payload, count: int, out: np.ndarray) -> None:
    """``out += decode(payload)`` without materialising a dense array for top-k."""
    if codec == Codec.TOPK:
        _check_len(codec, payload, count)
        idx, vals = _topk_parts(payload, count)
        out[idx] += vals
    else:
        out += decode(codec, payload, count)
