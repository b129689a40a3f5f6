"""Simulated machines for the vibration scenario (``fractal swarm --scenario vibration``).

One machine per node, each at its own normal operating point (shaft frequency, amplitudes of
its first two harmonics on two accelerometer axes, noise, a slow load swing), publishing its
readings as SenML packs (RFC 8428) on ``sensors/{swarm}/{machine}/accel``. Faults are injected
on a schedule fixed at start and recorded (``Schedule.write``: a JSON file; ``Simulator.schedule``):

- ``bearing``: a bearing defect tone (3.57 x the shaft frequency), amplitude-modulated by the shaft;
- ``imbalance``: the 1x component grows 1.8-fold on both axes;
- ``shift``: the machine runs 12 % faster than its normal speed.

A fault's ``severity`` scales its departure from normal (1.0 as above; 0.25: a tone a quarter as
loud, 1.2-fold imbalance, a 3 % speed shift).

The signal is a pure function of the machine, the time and the fault (:func:`readings`), so the
benchmark and the tests can draw held-out windows exactly as the nodes' streams cut them
(:func:`windows`). Simulated time may run faster than the wall clock (``speed``): readings carry
their simulated times, and the nodes window by those.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fractal.files import atomic_write

if TYPE_CHECKING:
    from federation.mqtt import MqttLink

__all__ = ["RATE_HZ", "WINDOW", "HOP", "AXES", "FaultKind", "Machine", "Fault", "Schedule", "machines",
           "make_schedule", "readings", "windows", "senml_pack", "topic", "field_names", "Simulator"]

log = logging.getLogger("fractal.swarm.vibration")

RATE_HZ = 500.0
WINDOW = 640  # readings per window: its spectrum, 320 bins x 2 axes, is the fc-autoencoder's 640 inputs
HOP = 160
AXES = ("ax", "ay")
BEARING_ORDER = 3.57  # outer-race defect frequency / shaft frequency of a typical deep-groove bearing
LOAD_PERIOD_S = 37.0


class FaultKind(enum.StrEnum):
    BEARING = "bearing"
    IMBALANCE = "imbalance"
    SHIFT = "shift"


@dataclass(frozen=True)
class Machine:
    """A machine's normal operating point (per axis: amplitude of 1x and 2x, their phases)."""

    name: str
    shaft_hz: float
    a1: tuple[float, float]
    a2: tuple[float, float]
    phase: tuple[float, float]
    noise: float
    load_swing: float  # relative amplitude swing over LOAD_PERIOD_S

    def std(self) -> tuple[float, float]:
        """Per-axis standard deviation of normal readings (the stream's normalisation)."""
        return tuple(float(np.sqrt((a * a + b * b) / 2 + self.noise ** 2))  # type: ignore[return-value]
                     for a, b in zip(self.a1, self.a2, strict=True))


@dataclass(frozen=True)
class Fault:
    machine: str
    kind: FaultKind
    start: float  # unix s (simulated time)
    end: float
    severity: float = 1.0


@dataclass
class Schedule:
    """The simulated plant: its machines, when simulated time starts, and every fault."""

    t0: float
    rate_hz: float
    machines: list[Machine]
    faults: list[Fault] = field(default_factory=list)

    def fault_at(self, machine: str, t: float) -> FaultKind | None:
        for f in self.faults:
            if f.machine == machine and f.start <= t < f.end:
                return f.kind
        return None

    def to_json(self) -> dict:
        return {"t0": self.t0, "rate_hz": self.rate_hz, "machines": [asdict(m) for m in self.machines],
                "faults": [{**asdict(f), "kind": f.kind.value} for f in self.faults]}

    def write(self, path: Path) -> None:
        atomic_write(path, json.dumps(self.to_json(), indent=1))


def machines(n: int, *, seed: int = 0) -> list[Machine]:
    """``n`` machines with distinct normal operating points (shaft 12, 15, 18, ... Hz, +-0.5)."""
    out = []
    for i in range(n):
        rng = np.random.default_rng(seed * 1000 + i)
        out.append(Machine(name=f"machine-{i + 1}", shaft_hz=float(12.0 + 3.0 * i + rng.uniform(-0.5, 0.5)),
                           a1=(float(rng.uniform(0.8, 1.2)), float(rng.uniform(0.5, 0.9))),
                           a2=(float(rng.uniform(0.2, 0.4)), float(rng.uniform(0.1, 0.3))),
                           phase=(float(rng.uniform(0, 2 * np.pi)), float(rng.uniform(0, 2 * np.pi))),
                           noise=float(rng.uniform(0.03, 0.08)), load_swing=float(rng.uniform(0.05, 0.1))))
    return out


def make_schedule(ms: list[Machine], t0: float, *, warmup_s: float, every_s: float, length_s: float,
                  horizon_s: float, rate_hz: float = RATE_HZ, severity: float = 1.0) -> Schedule:
    """Faults after ``warmup_s`` of normal running: one every ``every_s`` per machine (kinds in
    turn, machines staggered), each ``length_s`` long, up to ``horizon_s``."""
    faults = []
    kinds = list(FaultKind)
    for i, m in enumerate(ms):
        k, t = i, warmup_s + (i * every_s) / max(1, len(ms))
        while t + length_s <= horizon_s:
            faults.append(Fault(m.name, kinds[k % len(kinds)], t0 + t, t0 + t + length_s, severity))
            k, t = k + 1, t + every_s
    faults.sort(key=lambda f: f.start)
    return Schedule(t0=t0, rate_hz=rate_hz, machines=list(ms), faults=faults)


def readings(m: Machine, t: np.ndarray, fault: FaultKind | None = None, severity: float = 1.0) -> np.ndarray:
    """Accelerometer readings (len(t), 2) of machine ``m`` at times ``t`` (s), raw (not normalised)."""
    t = np.asarray(t, np.float64)
    seed = (zlib.crc32(m.name.encode()), int(t[0] * 1000) & 0xFFFFFFFF) if len(t) else 0
    rng = np.random.default_rng(seed)  # the same noise for the same readings, in any process
    f = m.shaft_hz * (1.0 + 0.12 * severity if fault is FaultKind.SHIFT else 1.0)
    load = 1.0 + m.load_swing * np.sin(2 * np.pi * t / LOAD_PERIOD_S)
    imb = 1.0 + 0.8 * severity if fault is FaultKind.IMBALANCE else 1.0
    tt = t - np.floor(t / 1000.0) * 1000.0  # keep phases accurate at unix times (float64)
    out = np.empty((len(t), 2), np.float64)
    for ax in range(2):
        w = 2 * np.pi * f * tt + m.phase[ax] + ax * np.pi / 2
        out[:, ax] = load * (imb * m.a1[ax] * np.sin(w) + m.a2[ax] * np.sin(2 * w + 0.3))
        if fault is FaultKind.BEARING:
            tone = np.sin(2 * np.pi * BEARING_ORDER * f * tt)
            out[:, ax] += 0.35 * severity * m.a1[0] * (1 + np.sin(w)) * tone
        out[:, ax] += rng.normal(0.0, m.noise, len(t))
    return out


def windows(m: Machine, n: int, fault: FaultKind | None, *, rng: np.random.Generator, t0: float = 1.7e9,
            span_s: float = 3600.0, severity: float = 1.0) -> np.ndarray:
    """``n`` model inputs (n, WINDOW) from windows at random times, as the node's stream makes them
    (normalised, amplitude spectrum, bins x axes flattened)."""
    from edgenode.streams.window import spectrum

    std = np.asarray(m.std())
    ts = t0 + rng.uniform(0, span_s, n)
    offs = np.arange(WINDOW) / RATE_HZ
    return np.stack([spectrum(readings(m, t + offs, fault, severity) / std).ravel() for t in ts])


def topic(swarm: str, machine: str) -> str:
    return f"sensors/{swarm}/{machine}/accel"


def field_names(machine: str) -> list[str]:
    """The SenML names of a machine's axes (the node's stream ``fields``)."""
    return [f"urn:dev:{machine}:{a}" for a in AXES]


def senml_pack(machine: str, t0: float, values: np.ndarray, rate_hz: float) -> bytes:
    """One SenML pack: base name and time, then one record per axis and reading."""
    recs: list[dict] = [{"bn": f"urn:dev:{machine}:", "bt": round(t0, 6)}]
    for i, row in enumerate(values.tolist()):
        dt = round(i / rate_hz, 6)
        recs += [{"n": a, "v": round(v, 5), "t": dt} for a, v in zip(AXES, row, strict=True)]
    return json.dumps(recs, separators=(",", ":")).encode()


class Simulator(threading.Thread):
    """Publishes every machine's readings in packs of ``pack_s`` (simulated seconds) through
    ``link``; simulated time runs ``speed`` times the wall clock. ``on_fault_end(fault)`` is called
    once a fault is over (the scenario reports it to the node as a late label)."""

    def __init__(self, link: MqttLink, swarm: str, schedule: Schedule, *, speed: float = 1.0,
                 pack_s: float = 0.1, on_fault_end: Callable[[Fault], None] | None = None,
                 duration_s: float | None = None) -> None:
        super().__init__(name="vibration-sim", daemon=True)
        self.link = link
        self.swarm = swarm
        self.schedule = schedule
        self.speed = speed
        self.pack_s = pack_s
        self.on_fault_end = on_fault_end
        self.duration_s = duration_s
        self.published = 0  # readings per axis, all machines
        self.sim_now = schedule.t0
        self._halt = threading.Event()
        # time only moves forward: walk each machine's faults (and all faults by end) once
        self._ahead = {m.name: sorted((f for f in schedule.faults if f.machine == m.name),
                                      key=lambda f: f.start) for m in schedule.machines}
        self._by_end = sorted(schedule.faults, key=lambda f: f.end)
        self._ended = 0

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        sched = self.schedule
        n = max(1, round(self.pack_s * sched.rate_hz))
        wall0, sim = time.monotonic(), sched.t0
        while not self._halt.is_set():
            if self.duration_s is not None and sim - sched.t0 >= self.duration_s:
                break
            ts = sim + np.arange(n) / sched.rate_hz
            for m in sched.machines:
                f = self._fault(m.name, float(ts[0]))
                vals = readings(m, ts, None) if f is None else readings(m, ts, f.kind, f.severity)
                try:
                    self.link.publish(topic(self.swarm, m.name),
                                      senml_pack(m.name, float(ts[0]), vals, sched.rate_hz),
                                      qos=0)
                except Exception as exc:  # noqa: BLE001 - a broker hiccup loses a pack, as a sensor would
                    log.debug("publish failed: %s", exc)
            sim += n / sched.rate_hz
            self.published += n * len(sched.machines)
            self.sim_now = sim
            self._report_ended(sim)
            ahead = (sim - sched.t0) / self.speed - (time.monotonic() - wall0)
            if ahead > 0:
                self._halt.wait(ahead)

    def _fault(self, machine: str, t: float) -> Fault | None:
        ahead = self._ahead[machine]
        while ahead and ahead[0].end <= t:
            ahead.pop(0)
        return ahead[0] if ahead and ahead[0].start <= t else None

    def _report_ended(self, sim: float) -> None:
        while self._ended < len(self._by_end) and self._by_end[self._ended].end <= sim:
            f = self._by_end[self._ended]
            self._ended += 1
            if self.on_fault_end is not None:
                try:
                    self.on_fault_end(f)
                except Exception:  # noqa: BLE001 - reporting is best effort
                    log.exception("reporting the end of %s failed", f)
