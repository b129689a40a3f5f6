"""How a step combines the members' updates: one module per way, one table that picks it.

| aggregation    | screened (outlier_factor > 0) | compression  | aggregator                  |
|----------------|-------------------------------|--------------|-----------------------------|
| mean           | no                            | none, fp16   | :class:`Mean` (the ring)    |
| mean           | yes                           | none, fp16   | :class:`ScreenedMean`       |
| mean           | no / yes                      | int8, topk   | :class:`CodedMean`          |
| median         | either                        | any          | :class:`Median`             |
| trimmed_mean   | either                        | any          | :class:`TrimmedMean`        |

:func:`aggregator_for` reads the table for a resolved round (``federation.roundspec.resolve``).
"""

from __future__ import annotations

from typing import Protocol

from federation.aggregators.base import Aggregator, Combined, Exchanger, Step
from federation.aggregators.coded import CodedMean
from federation.aggregators.mean import Mean
from federation.aggregators.median import Median
from federation.aggregators.screened import ScreenedMean
from federation.aggregators.trimmed import TrimmedMean
from federation.modes import Compression
from federation.robust import Aggregation

__all__ = ["Aggregator", "Combined", "Exchanger", "Step", "Mean", "ScreenedMean", "CodedMean", "Median",
           "TrimmedMean", "TABLE", "Settings", "aggregator_for"]

_CODED = (Compression.INT8, Compression.TOPK)  # codecs with error feedback: no claim bounds them

# (aggregation, screened, coded) -> the aggregator
TABLE: dict[tuple[Aggregation, bool, bool], Aggregator] = {
    (Aggregation.MEAN, False, False): Mean(),
    (Aggregation.MEAN, True, False): ScreenedMean(),
    (Aggregation.MEAN, False, True): CodedMean(screened=False),
    (Aggregation.MEAN, True, True): CodedMean(screened=True),
    **{(Aggregation.MEDIAN, s, c): Median() for s in (False, True) for c in (False, True)},
    **{(Aggregation.TRIMMED_MEAN, s, c): TrimmedMean() for s in (False, True) for c in (False, True)},
}


class Settings(Protocol):
    """The settings that pick the aggregator (``federation.roundspec.ResolvedRound`` has them)."""

    @property
    def aggregation(self) -> Aggregation: ...

    @property
    def outlier_factor(self) -> float: ...

    @property
    def compression(self) -> Compression: ...


def aggregator_for(r: Settings) -> Aggregator:
    """The aggregator of a resolved round (its aggregation, outlier_factor and compression)."""
    return TABLE[(Aggregation(r.aggregation), r.outlier_factor > 0, Compression(r.compression) in _CODED)]
