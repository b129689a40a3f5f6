"""``make soak``: a 4-node swarm doing rounds for a bounded time under crashes and junk traffic.

While the fleet role (the real RoundManager, see :mod:`harness.netswarm`) runs short rounds back
to back, a chaos thread SIGKILLs a random node (never ``n0``, so one node's memory is measured
over the whole run) and restarts it a few seconds later, and an injector publishes garbage and
malformed messages with a plain paho client on the swarm's topics (commands, statuses, round
events, ring DATA/ACK frames, parameter broadcasts). ``--hostile`` adds well-formed forgeries
while a round runs: an abort of it and a ``round.failed`` event in a node's name, unsigned; an
abort signed by a key the keyring does not hold, claiming to be the fleet; and replays of genuine
signed commands and round events captured earlier. The swarm is a signed one (keys from
``deploy/keys.py``, PROTOCOL.md section 9) unless ``--unsigned``. At the end every node is
restarted if needed, a last round is run, and the report (JSON on stdout) gives rounds
attempted/committed/failed with reasons, messages injected per kind, commands rejected and
messages dropped per reason by the nodes (``/metrics``, summed over node lives), RSS per process
at start and end, and whether all nodes hold the same parameters. Needs root (network
namespaces, like the fault tests).

    python -m harness.soak --minutes 5 [--nodes 4] [--seed 1] [--hostile] [--unsigned] [--out soak.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from federation import topics
from federation.messages import EventKind, RoundAbort, RoundCommand, RoundEvent
from harness.netswarm import NetSwarm, NetSwarmOptions

__all__ = ["main", "soak"]

REPO = Path(__file__).resolve().parents[1]


class Injector(threading.Thread):
    """Publishes one junk message every 0.05-0.5 s on a random swarm topic (plain paho, QoS 0)."""

    def __init__(self, sw: NetSwarm, rng: random.Random, hostile: bool) -> None:
        super().__init__(name="soak-injector", daemon=True)
        import paho.mqtt.client as mqtt

        assert sw.broker is not None
        self.sw, self.rng, self.hostile = sw, rng, hostile
        self.counts: dict[str, int] = {}
        self.halt = threading.Event()
        port = sw.broker.port

        def connect() -> Any:
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="soak-injector")
            c.connect("127.0.0.1", port, keepalive=30)
            c.loop_start()  # paho's thread starts here, inside the broker host's namespace
            return c

        self.client = sw.net.call(sw.net.broker, connect)
        # Genuine messages seen on the command and round-event topics (the latest 100 of each),
        # replayed later (--hostile): commands reach the nodes, events the fleet.
        self.captured: dict[str, collections.deque[tuple[str, bytes]]] = {
            "cmd": collections.deque(maxlen=100), "event": collections.deque(maxlen=100)}
        self._rogue: Any = None
        self._ours: dict[bytes, None] = {}  # payloads we published, oldest first (bounded), see _remember
        if hostile and sw.opts.signed:
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

            from federation.auth import Signer

            self._rogue = Signer("fleet", "rogue-fleet-key", Ed25519PrivateKey.generate())
            s = sw.opts.swarm

            def keep(client: Any, userdata: Any, msg: Any) -> None:
                # our own publications come back on the same topics: replaying them is not a replay
                if msg.payload and bytes(msg.payload) not in self._ours:
                    kind = "cmd" if msg.topic == topics.command(s) else "event"
                    self.captured[kind].append((msg.topic, bytes(msg.payload)))

            self.client.on_message = keep
            self.client.subscribe([(topics.command(s), 0), (topics.round_events_all(s), 0)])

    def _one(self) -> tuple[str, str, bytes]:
        s, rng, ids = self.sw.opts.swarm, self.rng, self.sw.ids
        node = rng.choice(ids)
        junk = rng.randbytes(rng.randint(0, 2048))
        kinds = ["garbage-cmd", "bad-json-cmd", "wrong-version-cmd", "ghost-round-cmd", "garbage-ring",
                 "garbage-ack", "garbage-params", "garbage-status", "garbage-event"]
        rid = self.sw.current_round
        if self.hostile and rid:
            kinds += ["forged-abort", "forged-failed-event"]
            if self._rogue is not None:
                kinds += ["rogue-signed-abort"]
                kinds += [f"replayed-{k}" for k, q in self.captured.items() if q]
        kind = rng.choice(kinds)
        if kind == "garbage-cmd":
            return kind, topics.command(s), junk
        if kind == "bad-json-cmd":
            bad = [b'{"kind": "round.start", "round_id": 7}', b"{", b"null", b"[]",
                   b'{"kind": "round.start", "steps": -1}']
            return kind, topics.command(s), rng.choice(bad)
        if kind == "wrong-version-cmd":
            v2 = RoundCommand(round_id="soak-v2", steps=1, participants=ids).model_dump(mode="json")
            return kind, topics.command(s), json.dumps({**v2, "v": 2}).encode()
        if kind == "ghost-round-cmd":  # well-formed, for members that do not exist: nobody may start
            ghost = RoundCommand(round_id=f"ghost{rng.randrange(10**6)}", steps=1,
                                 participants=["ghost-a", "ghost-b"])
            return kind, topics.command(s), ghost.model_dump_json().encode()
        if kind == "garbage-ring":
            return kind, topics.allreduce(s, node), junk
        if kind == "garbage-ack":
            return kind, topics.ack(s, node), junk[:64]
        if kind == "garbage-params":
            return kind, topics.params(s, node), junk
        if kind == "garbage-status":
            return kind, topics.status(s, "ghost"), junk
        if kind == "garbage-event":
            return kind, topics.round_events(s, "ghost", node), junk
        assert rid is not None
        if kind == "rogue-signed-abort":  # well signed, by a key nobody trusts
            t = topics.command(s)
            body = RoundAbort(round_id=rid, reason="soak forgery").model_dump_json().encode()
            return kind, t, self._rogue.sign(t, body)
        if kind.startswith("replayed-"):  # a signed command or event seen earlier, sent again
            t, payload = rng.choice(self.captured[kind.split("-", 1)[1]])
            return kind, t, payload
        if kind == "forged-abort":
            abort = RoundAbort(round_id=rid, reason="soak forgery")
            return kind, topics.command(s), abort.model_dump_json().encode()
        ev = RoundEvent(kind=EventKind.FAILED, round_id=rid, node_id=node, reason="soak forgery")
        return kind, topics.round_events(s, rid, node), ev.model_dump_json().encode()

    def run(self) -> None:
        while not self.halt.wait(self.rng.uniform(0.05, 0.5)):
            kind, topic, payload = self._one()
            self._remember(payload)
            self.client.publish(topic, payload, qos=0)
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def _remember(self, payload: bytes) -> None:
        """Note a payload we publish (the latest 1,000), so the capture never takes it for genuine."""
        self._ours.pop(payload, None)  # published again (a replay): it is the newest now
        self._ours[payload] = None
        if len(self._ours) > 1000:
            del self._ours[next(iter(self._ours))]

    def stop(self) -> None:
        self.halt.set()
        self.join(5)
        self.client.loop_stop()
        self.client.disconnect()


def _counters(sw: NetSwarm, k: int) -> tuple[int, dict[str, int]]:
    """One read of the node's ``/metrics``: ``fractal_node_commands_rejected_total`` and
    ``fractal_node_messages_rejected_total`` by reason (signed swarms); (0, {}) if unread."""
    try:
        text = sw.net.call(sw.net.nodes, lambda: sw._client(k).get("/metrics").text)
    except (httpx.HTTPError, OSError):
        return 0, {}
    m = re.search(r"^fractal_node_commands_rejected_total\s+([0-9.e+]+)", text, flags=re.M)
    dropped: dict[str, int] = {}
    pattern = r'^fractal_node_messages_rejected_total\{reason="([^"]+)"\}\s+([0-9.e+]+)'
    for reason, value in re.findall(pattern, text, flags=re.M):
        if float(value):
            dropped[reason] = int(float(value))
    return (int(float(m.group(1))) if m else 0), dropped


def _add(total: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        total[k] = total.get(k, 0) + v


def soak(artifact: Path, *, minutes: float, nodes: int = 4, seed: int = 1, hostile: bool = False,
         steps: int = 5, signed: bool = True) -> dict[str, Any]:
    from deploy.sensors import digits_shards

    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="fractal-soak-"))
    shards = digits_shards(nodes, seed=seed)
    report: dict[str, Any] = {"nodes": nodes, "minutes": minutes, "seed": seed, "hostile": hostile,
                              "signed": signed, "steps_per_round": steps}
    dropped: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    reasons: dict[str, int] = {}
    kills = 0
    killed: set[str] = set()
    rejected = 0
    try:
        with NetSwarm(NetSwarmOptions(artifact=artifact, workdir=work, nodes=nodes, tag="soak",
                                      signed=signed)) as sw:
            for k in range(nodes):
                sw.wait_http(k)
                if sw.post_samples(k, shards[k].x[:200], shards[k].y[:200]) != 200:
                    raise RuntimeError(f"{sw.ids[k]} refused samples")
            sw.wait_online()
            sw.run_round(2)  # warm-up: first TVM calls allocate what they keep
            sw.wait_idle()
            rss_start = sw.rss()
            rss_start["soak-driver"] = _self_rss()
            injector = Injector(sw, rng, hostile)
            injector.start()
            stop = threading.Event()
            down: set[int] = set()
            lock = threading.Lock()

            def chaos() -> None:
                nonlocal kills, rejected
                while not stop.wait(rng.uniform(5, 15)):
                    k = rng.randrange(1, nodes)
                    with lock:
                        refused, gone = _counters(sw, k)
                        rejected += refused
                        _add(dropped, gone)
                        sw.kill_node(k)
                        down.add(k)
                        killed.add(sw.ids[k])
                        kills += 1
                    if stop.wait(rng.uniform(2, 6)):
                        return
                    with lock:
                        sw.start_node(k)
                        down.discard(k)

            ct = threading.Thread(target=chaos, name="soak-chaos", daemon=True)
            ct.start()
            deadline = time.monotonic() + minutes * 60
            while time.monotonic() < deadline:
                try:
                    # like an operator, wait until nodes finished the last round: the fleet itself would
                    # also pick nodes still busy with a round it already failed (they refuse at once)
                    sw.wait_for(lambda: len(sw.online(idle_only=True)) >= 2, 60, "two idle nodes")
                    out = sw.run_round(steps, timeout=120, idle_only=True)
                except Exception as exc:  # noqa: BLE001 - a refused start (e.g. < 2 online) is an outcome too
                    out = None
                    why = f"not started: {str(exc).split(';')[0][:80]}"
                    reasons[why] = reasons.get(why, 0) + 1
                    outcomes["not-started"] = outcomes.get("not-started", 0) + 1
                    time.sleep(0.5)
                if out is not None:
                    outcomes[out.state] = outcomes.get(out.state, 0) + 1
                    if not out.committed:
                        why = _reason_class(out.reason or "")
                        reasons[why] = reasons.get(why, 0) + 1
            stop.set()
            ct.join(30)
            injector.stop()
            for k in sorted(down):
                sw.start_node(k)
            for k in range(nodes):
                sw.wait_http(k)
            sw.wait_online(timeout=120)
            rss_end = sw.rss()
            rss_end["soak-driver"] = _self_rss()
            final = sw.run_round(steps)
            sw.wait_idle()
            params = sw.params()
            fleet_dropped = {r.value: n for r, n in getattr(sw.fleet_link, "rejected", {}).items() if n}
            for k in range(nodes):
                refused, gone = _counters(sw, k)
                rejected += refused
                _add(dropped, gone)
            report.update({
                "rounds": {"attempted": sum(outcomes.values()), **outcomes, "failure_reasons": reasons},
                "node_kills": kills,
                "injected": {"total": sum(injector.counts.values()), **dict(sorted(injector.counts.items()))},
                "commands_rejected_by_nodes": rejected,
                # signed swarms: every message a node (or the fleet) dropped before reading it, by reason
                "messages_dropped_by_nodes": {"total": sum(dropped.values()),
                                              **dict(sorted(dropped.items()))},
                "messages_dropped_by_fleet": {"total": sum(fleet_dropped.values()),
                                              **dict(sorted(fleet_dropped.items()))},
                "rss_mb": {p: {"start": _mb(rss_start.get(p)), "end": _mb(rss_end.get(p)),
                               "restarted": p in killed}
                           for p in sorted(set(rss_start) | set(rss_end))},
                "final_round": {"state": final.state, "reason": final.reason},
                "params_agree_at_end": len(set(params.values())) == 1,
                "params_at_end": {n: [v, h[:12]] for n, (v, h) in params.items()},
            })
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _reason_class(reason: str) -> str:
    """A failure reason without round ids and numbers, so equal causes count together."""
    r = re.sub(r"r\d{8}-\d{6}-[0-9a-f]+(/\d+)?", "R", reason)
    r = re.sub(r"\d+(\.\d+)?", "N", r)
    return r[:120]


def _self_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _mb(b: int | None) -> float | None:
    return None if b is None else round(b / 2**20, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", "5")))
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="steps per round")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hostile", action="store_true", help="also inject well-formed forgeries")
    ap.add_argument("--unsigned", action="store_true", help="an unsigned swarm (as before issue 12)")
    ap.add_argument("--out", help="also write the JSON report here")
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "netfaults"))
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("error: the soak needs root for network namespaces (help: run it as root, e.g. in CI)",
              file=sys.stderr)
        return 1
    if a.nodes < 2 or a.minutes <= 0:
        print("error: need --nodes >= 2 and --minutes > 0 (help: python -m harness.soak --help)",
              file=sys.stderr)
        return 1
    from compiler import host_preset_name
    from deploy.swarm import demo_artifact

    artifact = demo_artifact(Path(a.cache_dir), host_preset_name())
    t0 = time.monotonic()
    report = soak(artifact, minutes=a.minutes, nodes=a.nodes, seed=a.seed, hostile=a.hostile, steps=a.steps,
                  signed=not a.unsigned)
    from bench.host import machine_line

    report.update({"wall_s": round(time.monotonic() - t0, 1), "machine": machine_line(),
                   "loadavg_1m_end": round(os.getloadavg()[0], 2)})
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        with contextlib.suppress(OSError):
            Path(a.out).write_text(text + "\n")
    return 0 if report["params_agree_at_end"] else 2


if __name__ == "__main__":
    sys.exit(main())
