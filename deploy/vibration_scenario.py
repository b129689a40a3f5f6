"""The vibration scenario of ``fractal swarm --scenario vibration``: what it adds to the demo swarm.

Each node gets one simulated machine (deploy/vibration.py): its ``NODE.toml`` subscribes to the
machine's SenML topic and cuts windows of 640 readings x 2 axes (hop 160, normalised by the
machine's nominal per-axis spread) and hands their amplitude spectra (320 bins x 2 axes) to the
zoo's ``fc-autoencoder``, which learns the machine's normal from these unlabelled windows. The
simulator publishes through the swarm's broker and
writes its fault schedule to ``faults.json``; when a fault is over the scenario reports it to its
node as a late label (``POST /v1/labels``, label 1 for the fault's time range: as a maintenance
log would), so fault windows leave the training and threshold data and the dashboard marks them.

Training rounds are the fleet's automatic rounds (``PUT /api/auto-rounds``, api/fleet/autorounds.py):
:func:`auto_round_policy` asks for a round whenever the nodes hold ``min_samples`` new windows each
since the last committed round, at least ``round_every_s`` apart; :class:`RoundDriver` sets it once
the fleet answers. The scenario starts no round itself.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from deploy.vibration import HOP, RATE_HZ, WINDOW, Fault, Machine, Schedule, Simulator, field_names, topic

__all__ = ["ScenarioOptions", "node_toml", "auto_round_policy", "RoundDriver", "Labeller", "VibrationRun",
           "label_range"]

log = logging.getLogger("fractal.swarm.vibration")


@dataclass(frozen=True)
class ScenarioOptions:
    speed: float = 1.0  # simulated seconds per wall second
    warmup_s: float = 60.0  # simulated seconds of normal running before the first fault
    fault_every_s: float = 40.0  # per machine
    fault_s: float = 8.0
    fault_severity: float = 1.0  # deploy/vibration.py: 1.0 as documented, smaller is subtler
    horizon_s: float = 6 * 3600.0  # faults are scheduled up to this far (simulated)
    duration_s: float | None = None  # stop publishing after this long (simulated); None = until stopped
    round_every_s: float = 60.0  # at least this many wall seconds between rounds (>= 60)
    round_steps: int = 200
    round_lr: float | None = 0.003
    min_samples: int = 150  # every node holds this many windows before the first round


def node_toml(m: Machine, swarm: str) -> str:
    """The ``[anomaly]`` and ``[[streams]]`` tables of a node watching machine ``m``."""
    fields = ", ".join(f'"{f}"' for f in field_names(m.name))
    std = ", ".join(f"{s:.4f}" for s in m.std())
    return ('worker_priority = "nice"  # SCHED_IDLE could starve rounds behind the stream ingestion\n'
            "\n[anomaly]\n"
            "percentile = 99.0                     # threshold: this percentile of normal scores\n"
            "refresh_samples = 100\n"
            "\n[[streams]]                           # the machine's accelerometer, SenML over MQTT\n"
            'name = "accel"\n'
            f'topic = "{topic(swarm, m.name)}"\n'
            'format = "senml"\n'
            f"fields = [{fields}]\n"
            f"sample_rate_hz = {RATE_HZ}\n"
            f"window = {WINDOW}\n"
            f"hop = {HOP}\n"
            'transform = "spectrum"                # 320 bins x 2 axes = the autoencoder\'s 640 inputs\n'
            "mean = [0.0, 0.0]\n"
            f"std = [{std}]               # the machine's nominal spread per axis\n"
            "gap_tolerance_s = 0.02\n"
            "max_delay_s = 0.05\n")


def auto_round_policy(nodes: int, opts: ScenarioOptions) -> dict:
    """The fleet's automatic-round policy for this scenario (one JSON object, as ``PUT
    /api/auto-rounds`` takes it): the samples trigger at ``min_samples`` new windows per node
    (each node counts for at most half the threshold, so with two nodes both must hold them),
    rounds at least ``round_every_s`` apart (whole minutes: the fleet's floor is one)."""
    spacing_min = min(24 * 60.0, max(1.0, opts.round_every_s / 60.0))
    return {"enabled": True,
            "schedule": {"enabled": False},
            "samples": {"enabled": True, "threshold": max(2, nodes * opts.min_samples)},
            "min_spacing_min": spacing_min,
            "round": {"steps": opts.round_steps, "lr": opts.round_lr}}


class RoundDriver(threading.Thread):
    """Hands the scenario's policy to the fleet (retrying until the fleet answers), then ends."""

    def __init__(self, fleet_url: str, token: str, nodes: int, opts: ScenarioOptions) -> None:
        super().__init__(name="vibration-rounds", daemon=True)
        self.client = httpx.Client(base_url=fleet_url, headers={"Authorization": f"Bearer {token}"},
                                   timeout=30)
        self.policy = auto_round_policy(nodes, opts)
        self.applied = threading.Event()
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    r = self.client.put("/api/auto-rounds", json=self.policy)
                    if r.status_code == 200:
                        self.applied.set()
                        return
                    # a refusal is a bug in the policy above, not a reason to retry forever
                    log.error("the fleet refused the scenario's automatic-round policy: %s %s",
                              r.status_code, r.text[:200])
                    return
                self._halt.wait(1.0)
        finally:
            self.client.close()


def label_range(f: Fault) -> tuple[float, float]:
    """The ``taken`` range of the windows a fault touched: windows are taken at their end."""
    return f.start, f.end + WINDOW / RATE_HZ


def fault_windows(f: Fault) -> int:
    """How many windows a fault touches (their ends fall in :func:`label_range`)."""
    since, until = label_range(f)
    return int((until - since) * RATE_HZ / HOP)


class Labeller(threading.Thread):
    """Reports finished faults to their nodes as late labels (label 1 over the fault's windows),
    as a maintenance log would. A node may store a fault's windows after the simulator moved on
    (its stream lags under load): the label is sent again every ``retry_s`` until the node
    labelled all but one of the fault's windows, for at most ``give_up_s``."""

    def __init__(self, node_urls: dict[str, str], token: str, *, retry_s: float = 2.0,
                 give_up_s: float = 300.0) -> None:
        super().__init__(name="vibration-labels", daemon=True)
        self.node_urls = node_urls  # machine name -> node API URL
        self.headers = {"Authorization": f"Bearer {token}"}
        self.retry_s, self.give_up_s = retry_s, give_up_s
        self.labelled = 0  # faults whose windows are labelled
        self._pending: list[tuple[float, float, Fault]] = []  # (next try, first try, fault)
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def __call__(self, f: Fault) -> None:
        now = time.monotonic()
        with self._lock:
            self._pending.append((now, now, f))

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        with httpx.Client(headers=self.headers, timeout=10) as client:
            while not self._halt.wait(0.5):
                now = time.monotonic()
                with self._lock:
                    due = [p for p in self._pending if p[0] <= now]
                    self._pending = [p for p in self._pending if p[0] > now]
                for _, first, f in due:
                    if not self._report(client, f) and now - first < self.give_up_s:
                        with self._lock:
                            self._pending.append((now + self.retry_s, first, f))

    def _report(self, client: httpx.Client, f: Fault) -> bool:
        since, until = label_range(f)
        try:
            r = client.post(f"{self.node_urls[f.machine]}/v1/labels",
                            json={"label": 1, "since": since, "until": until})
            r.raise_for_status()
        except httpx.HTTPError as exc:
            log.debug("label for %s: %s", f, exc)
            return False
        done = int(r.json()["labelled"]) >= fault_windows(f) - 1
        self.labelled += done
        return done


@dataclass
class VibrationRun:
    """The scenario's running parts (the swarm launcher stops them before the nodes)."""

    schedule: Schedule
    simulator: Simulator
    link: object  # federation.mqtt.MqttLink
    labeller: Labeller
    faults_file: Path
    driver: RoundDriver | None = None

    def start_rounds(self, fleet_url: str, token: str, opts: ScenarioOptions) -> RoundDriver:
        self.driver = RoundDriver(fleet_url, token, len(self.schedule.machines), opts)
        self.driver.start()
        return self.driver

    def stop(self) -> None:
        if self.driver is not None:
            self.driver.stop()
        self.simulator.stop()
        self.labeller.stop()
        self.simulator.join(5)
        self.labeller.join(5)
        if self.driver is not None:
            self.driver.join(5)
        with contextlib.suppress(Exception):
            self.link.close()  # type: ignore[attr-defined]


def start_vibration(broker_url: str, swarm: str, schedule: Schedule, node_urls: dict[str, str], token: str,
                    faults_file: Path, opts: ScenarioOptions) -> VibrationRun:
    """Write the fault schedule and start publishing every machine's readings."""
    from federation.mqtt import MqttLink

    schedule.write(faults_file)
    link = MqttLink(broker_url, swarm=swarm, client_id=f"vibration-sim-{int(time.time() * 1000) % 10**9}")
    labeller = Labeller(node_urls, token)
    sim = Simulator(link, swarm, schedule, speed=opts.speed, on_fault_end=labeller,
                    duration_s=opts.duration_s)
    labeller.start()
    sim.start()
    return VibrationRun(schedule, sim, link, labeller, faults_file)
