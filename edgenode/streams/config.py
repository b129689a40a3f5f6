"""The ``[[streams]]`` tables of ``NODE.toml``: which sensor topics feed which model input.

Example (a 2-axis accelerometer at 1 kHz, SenML, windows of 320 readings every 160)::

    [[streams]]
    name = "vib"                          # metrics label; unique per node
    topic = "sensors/machine-1/#"         # MQTT topic filter on the node's broker
    format = "senml"                      # senml | json | f32
    fields = ["urn:dev:m1:ax", "urn:dev:m1:ay"]   # SenML names / JSON fields -> channels 0, 1, ...
    input = "x"                           # model input (default: the only one)
    sample_rate_hz = 1000.0
    window = 320                          # readings per window
    hop = 160                             # readings between window starts (default = window)
    layout = "time-major"                 # window (rows, channels) or "channel-major" (channels, rows)
    transform = "none"                    # or "spectrum": amplitude spectrum per channel, window // 2 bins
    mean = [0.0, 0.0]                     # per-channel normalisation (x - mean) / std, optional
    std = [1.0, 1.0]
    gap_tolerance_s = 0.005               # holes up to this long hold the last value; longer: a new window
    max_delay_s = 0.01                    # how long an out-of-order reading may still fill its slot
    time_field = "t"                      # json: the time field (absent in a reading: arrival time)
    queue = 1024                          # messages buffered between MQTT and the windower

The window (``window x channels`` values; with ``transform = "spectrum"``, ``window // 2`` bins per
channel) must have as many values as the model input holds without its batch dimension; the
node checks this at start. The spectrum (:func:`edgenode.streams.window.spectrum`) is taken after
the normalisation: a Hann-windowed FFT's amplitudes without the DC bin, row i at
``(i + 1) * sample_rate_hz / window`` Hz; its values are what phase-free models of vibration and sound
learn from (MLPerf Tiny's anomaly model reads spectra, not raw samples).
"""

from __future__ import annotations

import enum
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgenode.streams.window import WindowSpec

__all__ = ["StreamConfig", "StreamFormat", "Layout", "Transform"]


class StreamFormat(enum.StrEnum):
    SENML = "senml"
    JSON = "json"
    F32 = "f32"


class Layout(enum.StrEnum):
    TIME_MAJOR = "time-major"
    CHANNEL_MAJOR = "channel-major"


class Transform(enum.StrEnum):
    NONE = "none"
    SPECTRUM = "spectrum"


class StreamConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    topic: str = Field(min_length=1, max_length=1024)
    format: StreamFormat = StreamFormat.SENML
    fields: list[str] = Field(min_length=1, max_length=1024)
    input: str | None = None
    sample_rate_hz: float = Field(gt=0, le=1_000_000)
    window: int = Field(ge=1, le=1_000_000)
    hop: int | None = Field(default=None, ge=1, le=1_000_000)
    layout: Layout = Layout.TIME_MAJOR
    transform: Transform = Transform.NONE
    mean: list[float] | None = None
    std: list[float] | None = None
    gap_tolerance_s: float = Field(default=0.0, ge=0)
    max_delay_s: float = Field(default=0.0, ge=0)
    time_field: str = "t"
    queue: int = Field(default=1024, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        levels = self.topic.split("/")
        if "\x00" in self.topic or any(("#" in lv and (lv != "#" or i != len(levels) - 1)) or
                                        ("+" in lv and lv != "+") for i, lv in enumerate(levels)):
            raise ValueError("topic: not an MQTT topic filter ('+' fills a level, '#' ends the filter)")
        if levels[0] in ("fractal", "+", "#", ""):
            raise ValueError("topic: must start with a literal level other than 'fractal' (the swarm's "
                             "own topics are never sensor data)")
        if self.transform is Transform.SPECTRUM and self.window < 4:
            raise ValueError("window: a spectrum needs at least 4 readings")
        if len(set(self.fields)) != len(self.fields):
            raise ValueError("fields: a name appears twice")
        self.window_spec()  # mean/std lengths, std > 0
        if self.gap_slots + self.delay_slots > 10 * self.window + 100_000:
            raise ValueError("gap_tolerance_s / max_delay_s are too long for the sample rate")
        return self

    @property
    def rows(self) -> int:
        """Rows of a window handed to the model: readings, or spectrum bins."""
        return self.window // 2 if self.transform is Transform.SPECTRUM else self.window

    @property
    def channels(self) -> int:
        return len(self.fields)

    @property
    def gap_slots(self) -> int:
        return int(self.gap_tolerance_s * self.sample_rate_hz + 1e-9)

    @property
    def delay_slots(self) -> int:
        return int(self.max_delay_s * self.sample_rate_hz + 1e-9)

    def window_spec(self) -> WindowSpec:
        return WindowSpec(channels=self.channels, rate_hz=self.sample_rate_hz, length=self.window,
                          hop=self.hop or self.window, gap_slots=self.gap_slots, delay=self.delay_slots,
                          mean=None if self.mean is None else tuple(self.mean),
                          std=None if self.std is None else tuple(self.std))
