"""The fleet service: one MQTT connection feeding the node registry, the round manager and
the event bus. HTTP routes only call into this object.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable

from pydantic import BaseModel, ValidationError

from api.fleet.asyncrounds import start_aggregator
from api.fleet.autorounds import AutoRoundPolicy, AutoRounds
from api.fleet.enrollment import EnrollmentManager, device_broker_url
from api.fleet.errors import FleetError
from api.fleet.events import EventBus, EventType
from api.fleet.history import FleetHistory
from api.fleet.images import GrantRefused, ImageCatalogue
from api.fleet.leadership import Leadership, PostgresLeader, SoleLeader
from api.fleet.operations import Operations
from api.fleet.registry import NodeRegistry
from api.fleet.rollback import Rollback, RollbackManager, RollbackRequest
from api.fleet.rollouts import ImageRollbackRequest, Rollout, RolloutManager, RolloutRequest
from api.fleet.rounds import (
    PLOT_POINTS,
    Round,
    RoundManager,
    RoundRejected,
    RoundRequest,
    RoundState,
    Trigger,
)
from api.fleet.settings import FleetSettings
from federation import grants, topics
from federation.asyncagg import Aggregator
from federation.auth import Keyring, Reject
from federation.messages import EventKind, NodeState, RoundAbort, parse_event, parse_status
from federation.signed import Identity, SignedLink, load_identity
from federation.transport import PubSubLink

__all__ = ["FleetService", "Link", "LinkFactory", "TAKEN_OVER"]

log = logging.getLogger("fractal.fleet")


# The MQTT connection: federation's one publish/subscribe Protocol (``federation.mqtt.MqttLink``).
Link = PubSubLink


LinkFactory = Callable[[FleetSettings], Link]

# Why a round the previous leader ran is failed by the process that takes the lead from it.
TAKEN_OVER = "the leading fleet process stopped during the round; fleet process {me} took the lead"
LEADER_KEY = "fleet.leader"  # kv row: who leads now (its URL for followers' redirects)


def default_link(settings: FleetSettings) -> Link:
    """Connect to the broker in ``settings.broker`` with ``federation.mqtt.MqttLink``."""
    from federation.mqtt import MqttLink

    tls = {"ca": settings.tls_ca} if settings.tls_ca else None
    client_id = settings.client_id or f"fleet-{secrets.token_hex(4)}"
    return MqttLink(settings.broker, swarm=settings.swarm, client_id=client_id, tls=tls)


class FleetService:
    """Start with :meth:`start`, stop with :meth:`stop`; safe to call from any thread."""

    def __init__(self, settings: FleetSettings, link_factory: LinkFactory | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        topics.validate_id(settings.swarm, "swarm")
        self.settings = settings
        self.clock = clock
        self.bus = EventBus()
        self.registry = NodeRegistry()
        self.history = FleetHistory(settings.store_target())
        # SQLite: this is the only fleet process, it leads from now. PostgreSQL: it leads once it
        # holds the swarm's advisory lock (api/fleet/leadership.py); until then it follows.
        self.leadership: Leadership = (PostgresLeader(settings.database, settings.swarm,
                                                      check_s=settings.leader_check_s)
                                       if settings.database else SoleLeader())
        self.on_lost_lead: Callable[[str], None] | None = None  # serve_fleet stops the process
        if not settings.database:
            self.history.close_interrupted(clock())
        # One coordinator of which operations may run together, asked by every manager's start.
        self.operations = Operations()
        self.rounds = RoundManager(
            swarm=settings.swarm, publish=self._publish,
            start_timeout_s=settings.round_start_timeout_s, idle_timeout_s=settings.round_idle_timeout_s,
            step_timeout_s=settings.step_timeout_s, max_steps=settings.max_steps, history=settings.history,
            store=self.history, margin=settings.rollback_margin,
            offline_grace_s=settings.round_offline_grace_s, operations=self.operations)
        # Rounds the fleet starts by itself (a schedule, new samples), through start_round.
        self.auto = AutoRounds(self.history, clock, stamp=clock)
        self._next_auto_check = 0.0
        self._auto_published: dict | None = None
        self.rollbacks = RollbackManager(swarm=settings.swarm, publish=self._publish,
                                         timeout_s=settings.rollback_timeout_s, store=self.history,
                                         operations=self.operations)
        # Download grants for nodes are keyed by the operator token: a restarted fleet honours them.
        grant_key = hashlib.sha256(b"fractal-edge image grant\0" + settings.token.encode()).digest()
        self.images = (ImageCatalogue(settings.images_dir, settings.image_keys, grant_key=grant_key)
                       if settings.images_dir else None)
        self.rollouts = RolloutManager(swarm=settings.swarm, publish=self._publish,
                                       stage_timeout_s=settings.rollout_stage_timeout_s, store=self.history,
                                       grant=self.images.grant_query if self.images is not None else None,
                                       operations=self.operations)
        # Signed swarm: a download grant is only good together with the addressed node's proof.
        self._keyring: Keyring | None = (Keyring.load(settings.keyring_file)
                                         if settings.key_file and settings.keyring_file else None)
        self.rejected_messages = 0
        # per reason: federation.auth.Reject values, "malformed", "registry_full"
        self.rejected: Counter[str] = Counter()
        # Statuses and events are rejected on two subscription threads at once: a Counter's first
        # count of a reason (its __missing__) is not atomic, so the counts are kept under one lock.
        self._rejected_lock = threading.Lock()
        self._link_factory = link_factory or default_link
        self._link: Link | None = None
        self._stop = threading.Event()
        self._dirty: set[str] = set()  # running rounds with step updates not yet published
        self._dirty_lock = threading.Lock()
        self._watched: set[str] = set()  # a follower's rounds still running in the store
        self._round_events = threading.Lock()  # one reader+publisher of round states at a time
        self._round_seq = 0  # bumped by every published round state (see round_view)
        self._ticker: threading.Thread | None = None
        self._ident: Identity | None = None
        self.aggregator: Aggregator | None = None  # async rounds (settings.async_params)
        self.enrollment = EnrollmentManager(
            settings.store_target(), swarm=settings.swarm, broker_url=device_broker_url(settings),
            identity=None, keyring_file=settings.keyring_file, publish=self._publish_retained, clock=clock)

    # -- life cycle -----------------------------------------------------------------------
    def start(self) -> None:
        link = self._link_factory(self.settings)
        if self.settings.key_file and self.settings.keyring_file:
            ident = load_identity(self.settings.key_file, self.settings.keyring_file)
            # one keyring object: what enrolment adds or revokes, the link's verifier and grants see
            self._ident = self.enrollment.identity = ident
            self._keyring = ident.keyring
            link = SignedLink(link, ident.signer, ident.verifier(), on_reject=self._auth_reject)
        self._link = link
        if self.settings.dynsec_admin and self.enrollment.dynsec is None:
            from federation.dynsec import DynsecAdmin

            self.enrollment.dynsec = DynsecAdmin(self.settings.dynsec_admin)
        if self.leading:
            self.enrollment.publish_keyring()  # members that missed an update get it (retained)
        self._link.subscribe(topics.status_all(self.settings.swarm), self._on_status)
        self._link.subscribe(topics.round_events_all(self.settings.swarm), self._on_event)
        if self.leading:  # a follower starts it when it takes the lead
            self._start_aggregator()
        self._stop.clear()
        self._ticker = threading.Thread(target=self._tick_loop, name="fleet-ticker", daemon=True)
        self._ticker.start()
        self.leadership.start(self._take_lead, self._lose_lead)

    # -- leadership (api/fleet/leadership.py) ---------------------------------------------
    @property
    def leading(self) -> bool:
        """Does this process act (publish commands, run rounds, accept writes)? Else it follows."""
        return self.leadership.leading

    def my_url(self) -> str:
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "::") else self.settings.host
        return (self.settings.public_url or f"http://{host}:{self.settings.port}").rstrip("/")

    def leader(self) -> dict | None:
        """Who leads, as the leader recorded it: ``{"url", "process", "since"}`` (None: unknown)."""
        raw = self.history.get_value(LEADER_KEY)
        return json.loads(raw) if raw else None

    def leader_address(self) -> tuple[bool, str | None]:
        """(does this process lead, the leader's URL): what a follower's 503 answers with."""
        if self.leading:
            return True, self.my_url()
        try:
            info = self.leader()
        except FleetError:  # the database is away: the 503 still answers, without an address
            return False, None
        return False, info["url"] if info else None

    def _take_lead(self) -> None:
        """Won the lead (the leadership thread calls this): close the previous leader's running
        rounds as failed (their nodes are told to abort), reload the state it kept in the database."""
        now = self.clock()
        me = self.leadership.ident
        self.history.set_value(LEADER_KEY, json.dumps({"url": self.my_url(), "process": me, "since": now}))
        reason = TAKEN_OVER.format(me=me)
        closed = self.history.close_interrupted(now, reason)
        self.history.record_action("fleet.lead", {"process": me, "url": self.my_url(),
                                                  "failed_rounds": closed}, now)
        self.auto = AutoRounds(self.history, self.clock, stamp=self.clock)  # the policy as last stored
        self._next_auto_check = 0.0
        for rid in closed:
            try:
                self._publish(topics.command(self.settings.swarm), RoundAbort(round_id=rid, reason=reason))
            except Exception as exc:  # best effort, as any abort: the nodes' own timeouts end it too
                log.warning("round %s: could not publish the abort to the nodes: %s", rid, exc)
            self._publish_round(rid)
        if self._link is not None:
            self.enrollment.publish_keyring()
            self._start_aggregator()
        self.bus.publish(EventType.LEADER, {"role": "leader", "leader": self.my_url()})
        log.warning("fleet process %s leads swarm %s; rounds failed on takeover: %s", me,
                    self.settings.swarm, closed or "none")

    def _start_aggregator(self) -> None:
        """Asynchronous rounds (settings.async_params): the leader aggregates, from the stored version."""
        if self.settings.async_params and self.aggregator is None and self._link is not None:
            self.aggregator = start_aggregator(self.settings, self._link, self.history,
                                               on_change=self._async_changed)
            self._async_changed()

    def async_view(self) -> dict | None:
        """GET /api/async's body on the aggregating process, None elsewhere (the dashboard's card)."""
        agg = self.aggregator
        return None if agg is None else agg.status()

    def _async_changed(self) -> None:
        view = self.async_view()
        if view is not None:
            self.bus.publish(EventType.ASYNC, view)

    def _lose_lead(self, why: str) -> None:
        log.error("this fleet process stops: %s", why)
        if self.on_lost_lead is not None:
            self.on_lost_lead(why)

    def stop(self) -> None:
        self.leadership.stop()
        self._stop.set()
        if self.aggregator is not None:
            self.aggregator.close()
            self.aggregator = None
        if self._ticker:
            self._ticker.join(timeout=2)
        if self._link is not None:
            self._link.close()
            self._link = None
        if self.enrollment.dynsec is not None:
            self.enrollment.dynsec.close()
            self.enrollment.dynsec = None
        self.history.close()

    @property
    def connected(self) -> bool:
        """Started and (when the link can tell) currently connected to the broker."""
        return self._link is not None and self._link.connected

    # -- MQTT in --------------------------------------------------------------------------
    def _on_status(self, topic: str, payload: bytes) -> None:
        now = self.clock()
        node = topic.rsplit("/", 1)[-1]
        if not payload:  # retained status cleared: the node was decommissioned
            self.auto.forget(node)
            if self.registry.remove(node):
                self.bus.publish(EventType.NODE, {"node_id": node, "removed": True})
            return
        try:
            status = parse_status(payload)
        except ValidationError as exc:
            self._reject(topic, exc)
            return
        if status.node_id != node:
            self._reject(topic, f"node_id {status.node_id!r} does not match the topic")
            return
        view = self.registry.update(status, now)
        if view is None:
            self._reject(topic, f"registry full ({self.registry.max_nodes} nodes)", "registry_full")
            return
        if not self.leading:  # a follower shows the nodes; the leader acts on them
            self.bus.publish(EventType.NODE, view | {"left_out": None})
            return
        self.auto.on_status(node, status.model_version, status.samples_new)
        self.bus.publish(EventType.NODE, view | {"left_out": self.rounds.left_out().get(node)})
        if not view["online"]:
            if view["state"] == NodeState.HALTED.value:  # the board will not come back by itself
                ro = self.rollouts.on_halt(node, view["halt"] or "no reason given", now)
                if ro is not None:
                    self._rollout_changed(ro)
            # a Last Will also fires when a connection merely drops: the round waits for the grace
            self._rounds_changed(self.rounds.node_offline(node, now))
            return
        self.rounds.node_online(node, status.round_id)
        ro = self.rollouts.on_status(node, view["image"], now)
        if ro is not None:
            self._rollout_changed(ro)
        if status.state is NodeState.ONLINE:  # a training node still reports its old version
            rb = self.rollbacks.on_status(node, status.model_version, now)
            if rb is not None:
                self._rollback_changed(rb, now)

    def _on_event(self, topic: str, payload: bytes) -> None:
        try:
            ev = parse_event(payload)
        except ValidationError as exc:
            self._reject(topic, exc)
            return
        if topic != topics.round_events(self.settings.swarm, ev.round_id, ev.node_id):
            self._reject(topic, f"event of {ev.node_id!r} for round {ev.round_id!r} on another topic")
            return
        if not self.leading:  # the leader saves the round; show its stored copy at the next tick
            with self._dirty_lock:
                self._dirty.add(ev.round_id)
            return
        left_out = self.rounds.left_out()
        rnd = self.rounds.on_event(ev, self.clock())
        if rnd is None:
            return
        if self.rounds.left_out() != left_out:  # the round's failures left a member out: show it
            for view in self.nodes():
                if view["left_out"] != left_out.get(view["node_id"]):
                    self.bus.publish(EventType.NODE, view)
        if ev.kind is EventKind.STEP and rnd.state is RoundState.RUNNING:
            # Coalesce step updates: the ticker publishes a running round at most once per tick,
            # so a long round with many nodes does not flood the event stream.
            with self._dirty_lock:
                self._dirty.add(rnd.round_id)
        else:
            self._rounds_changed([rnd])
            if rnd.state is RoundState.DONE:
                after = rnd.versions()[1]
                if after is not None:  # its members hold nothing new until their statuses say so
                    self.auto.committed(list(rnd.command.participants), after)
                self._judge(rnd)

    def _judge(self, rnd: Round) -> None:
        """Roll a DONE round back when its validation got worse than the margin allows."""
        verdict = self.rounds.judge(rnd.round_id)
        if verdict is None:
            return
        _, why = verdict
        if not self.settings.auto_rollback:
            log.warning("round %s: %s (auto rollback is off)", rnd.round_id, why)
            return
        before, after = rnd.versions()
        assert before is not None and after is not None  # a judged round is DONE
        now = self.clock()
        try:
            rb = self.rollbacks.start(
                RollbackRequest(nodes=list(rnd.command.participants), to_version=before),
                nodes=self.nodes(), now=now, by="auto", round_id=rnd.round_id, why=why,
                current={n: after for n in rnd.command.participants})
        except Exception as exc:  # a node went offline, the broker is gone: say so, keep the round
            log.warning("round %s: %s, but the rollback could not start: %s", rnd.round_id, why, exc)
            self.history.record_action("rollback.skipped", {"round_id": rnd.round_id, "why": why,
                                                            "reason": str(exc)}, now)
            return
        log.warning("round %s: %s; rolling back to v%d (%s)", rnd.round_id, why, before,
                    rb.command.rollback_id)
        self._rollback_changed(rb, now)

    def _count_rejected(self, reason: str) -> None:
        with self._rejected_lock:
            self.rejected[reason] += 1
            self.rejected_messages += 1  # last: whoever sees the total sees every reason counted

    def _reject(self, topic: str, why: object, reason: str = "malformed") -> None:
        self._count_rejected(reason)
        log.warning("rejected message on %s: %s", topic[:200], str(why).splitlines()[0][:300])

    def _auth_reject(self, topic: str, reason: Reject) -> None:
        # Not logged at warning level: a flood of forgeries must not flood the log too.
        self._count_rejected(reason.value)

    # -- periodic checks ------------------------------------------------------------------
    def _tick_loop(self) -> None:
        while not self._stop.wait(self.settings.tick_s):
            try:
                self.tick()
            except Exception:  # keep ticking: one bad tick must not freeze deadlines
                log.exception("fleet tick failed")

    def tick(self) -> None:
        """Expire silent nodes and overdue rounds (the ticker thread calls this)."""
        now = self.clock()
        if not self.leading:
            self._follow_tick(now)
            return
        for view in self.registry.expire(now):
            self.bus.publish(EventType.NODE, view)
            # silent for 1.5x its keepalive: long past any reconnect
            self._rounds_changed(self.rounds.node_offline(view["node_id"], now, immediate=True))
        self._rounds_changed(self.rounds.tick(now))
        rb = self.rollbacks.tick(now)
        if rb is not None:
            self._rollback_changed(rb, now)
        ro = self.rollouts.tick(now)
        if ro is not None:
            self._rollout_changed(ro)
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        for rid in sorted(dirty):
            self._publish_round(rid)
        if now >= self._next_auto_check:
            self._next_auto_check = now + self.settings.auto_check_s
            self.check_auto_rounds()

    def _follow_tick(self, now: float) -> None:
        """A follower's tick: expire silent nodes, show the rounds the leader changed."""
        for view in self.registry.expire(now):
            self.bus.publish(EventType.NODE, view)
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        # A round's final event may arrive here before the leader stored the final state: a round
        # stays watched (read again every tick) until the store says it ended.
        self._watched |= dirty
        for rid in sorted(self._watched):
            self._publish_round(rid)
            data = self.rounds.get(rid)
            if data is None or data["state"] != RoundState.RUNNING.value:
                self._watched.discard(rid)

    # -- automatic rounds (api/fleet/autorounds.py) ----------------------------------------
    def _auto_participants(self) -> dict[str, int]:
        """Who an automatic round would train now, with the version each holds: idle online nodes
        not left out (within the policy's ``round.nodes`` when it names them); their new samples
        count towards the threshold."""
        named = self.auto.policy.round.nodes
        rid = self.rounds.running()
        running = self.rounds.get(rid) if rid is not None else None
        # members of the running round, also before their statuses say they train
        busy = set(running["participants"]) if running is not None else set()
        return {n: int(v["model_version"]) for n, v in self._settled(self.nodes()).items()
                if v["state"] == NodeState.ONLINE.value and v["left_out"] is None
                and n not in busy and (named is None or n in named)}

    def check_auto_rounds(self) -> dict | None:
        """Start an automatic round when the policy says one is due (the ticker calls this every
        ``auto_check_s``); the started round, or None. Publishes the panel's view when it changed."""
        rnd = self.auto.check(self._auto_participants(), lambda req, trigger: self.start_round(req, trigger))
        self._publish_auto()
        return rnd

    def auto_view(self) -> dict:
        if not self.leading:  # the leader may have changed the policy: show it as stored
            self.auto = AutoRounds(self.history, self.clock, stamp=self.clock)
        return self.auto.view(self._auto_participants())

    def set_auto_policy(self, policy: AutoRoundPolicy) -> dict:
        """``PUT /api/auto-rounds``: store the policy (it survives a restart), publish the new view.
        RoundRejected (422) when its round asks for more steps than this fleet allows."""
        if policy.round.steps > self.settings.max_steps:
            raise RoundRejected(f"round.steps={policy.round.steps} exceeds this fleet's limit of "
                                f"{self.settings.max_steps}", 422)
        self.auto.set_policy(policy)
        self._next_auto_check = 0.0  # check at the next tick
        return self._publish_auto(force=True)

    def _publish_auto(self, force: bool = False) -> dict:
        view = self.auto_view()
        key = {k: v for k, v in view["status"].items() if k != "now"} | {"policy": view["policy"]}
        if force or key != self._auto_published:
            self._auto_published = key
            self.bus.publish(EventType.AUTO_ROUNDS, view)
        return view

    def _publish_round(self, round_id: str) -> None:
        """Publish the round's current state. Read and publish under one lock: threads (MQTT
        callbacks, the ticker, HTTP routes) then publish a round's states in the order they were
        read, so a stale copy read before a change can never reach the dashboard after it."""
        with self._round_events:
            data = self.rounds.get(round_id, PLOT_POINTS)
            if data is not None:
                self._round_seq += 1
                data["seq"] = self._round_seq
                self.bus.publish(EventType.ROUND, data)

    def round_view(self, round_id: str, max_points: int | None = None) -> dict | None:
        """One round as the HTTP API shows it, stamped with ``seq``: the number of the last round
        event published before it was read. A client that reads a round over HTTP while it also
        follows the event stream keeps the copy with the higher ``seq`` (ties: the later read).
        The two arrive over different connections, so an HTTP answer read before a change can
        reach the browser after the event of that change."""
        with self._round_events:
            data = self.rounds.get(round_id, max_points)
            if data is not None:
                data["seq"] = self._round_seq
        return data

    def round_history(self, max_points: int | None = PLOT_POINTS, *, limit: int = 50,
                      before: float | None = None) -> list[dict]:
        """A page of the round history, every round stamped with ``seq`` like :meth:`round_view`."""
        with self._round_events:
            rounds = self.rounds.history(max_points, limit=limit, before=before)
            for r in rounds:
                r["seq"] = self._round_seq
        return rounds

    def _rounds_changed(self, rounds: list[Round]) -> None:
        for rnd in rounds:
            self._publish_round(rnd.round_id)

    def _rollback_changed(self, rb: Rollback, now: float) -> None:
        data = rb.to_dict()
        if data["state"] == "done":  # the rounds it undid say so in the history
            info = {k: data[k] for k in ("rollback_id", "by", "to_version", "why", "finished_at")}
            for rid in self.rounds.mark_rolled_back(set(rb.command.nodes), rb.command.to_version, info):
                self._publish_round(rid)
        self.bus.publish(EventType.ROLLBACK, data)

    # -- operations used by the HTTP routes -----------------------------------------------
    def _publish(self, topic: str, msg: BaseModel) -> None:
        if self._link is None:
            raise RuntimeError("fleet service is not connected to the broker")
        self._link.publish(topic, msg.model_dump_json().encode(), retain=False, qos=1)

    def _publish_retained(self, topic: str, payload: bytes) -> None:
        if self._link is None:
            raise RuntimeError("fleet service is not connected to the broker")
        self._link.publish(topic, payload, retain=True, qos=1)

    def nodes(self) -> list[dict]:
        """The node table; ``left_out`` says why a node is left out of rounds (None: it is not)."""
        left_out = self.rounds.left_out()
        return [v | {"left_out": left_out.get(v["node_id"])} for v in self.registry.snapshot(self.clock())]

    def _settled(self, views: list[dict]) -> dict[str, dict]:
        """Views as of the nodes' last round reports: a node whose DONE for a round the fleet marked
        done arrived before its idle status is idle and holds that round's parameters (so a round
        POSTed right after the previous one reads ``done`` finds its participants idle)."""
        out = {}
        for v in views:
            p = self.rounds.finished_by(v["node_id"], v["round_id"]) if v["state"] == "training" else None
            if p is not None and v["online"]:
                version = p.model_version if p.model_version is not None else v["model_version"]
                v = v | {"state": "online", "round_id": None, "params_sha256": p.params_sha256 or "",
                         "model_version": version}
            out[v["node_id"]] = v
        return out

    def start_round(self, req: RoundRequest, trigger: Trigger = Trigger.OPERATOR) -> dict:
        """Start a round (the operator's ``POST /api/rounds``, or an automatic one with its trigger)."""
        now = self.clock()
        views = self._settled(self.nodes())
        rnd = self.rounds.start(req, online={n for n, v in views.items() if v["state"] == "online"},
                                halted={n: v["halt"] or "no reason given" for n, v in views.items()
                                        if v["state"] == NodeState.HALTED.value},
                                known=set(views), now=now,
                                holdings={n: v["params_sha256"] for n, v in views.items()},
                                val_counts={n: v["samples_val"] for n, v in views.items()},
                                site_of={n: v["site"] for n, v in views.items()}, trigger=trigger)
        self.history.record_action("start_round", {"round_id": rnd.round_id, "trigger": trigger.value,
                                                   "request": req.model_dump(mode="json")}, now)
        self._publish_round(rnd.round_id)
        return rnd.to_dict(PLOT_POINTS)

    def rollback(self, req: RollbackRequest) -> dict:
        """The operator's rollback (``POST /api/rollback``); RoundRejected when the swarm cannot."""
        now = self.clock()
        views = self._settled(self.nodes())
        rb = self.rollbacks.start(req, nodes=list(views.values()), now=now, by="operator")
        self._rollback_changed(rb, now)
        return rb.to_dict()

    def readmit(self, node_id: str) -> dict:
        """Take a node left out for failing rounds back into rounds (``POST /api/nodes/{id}/readmit``)."""
        if not self.registry.known(node_id):
            raise RoundRejected(f"unknown node {node_id!r}", 404)
        if not self.rounds.readmit(node_id):
            raise RoundRejected(f"node {node_id} is not left out of rounds")
        now = self.clock()
        self.history.record_action("readmit", {"node_id": node_id}, now)
        view = next(v for v in self.nodes() if v["node_id"] == node_id)
        self.bus.publish(EventType.NODE, view)
        return view

    def _rollout_changed(self, ro: Rollout) -> None:
        self.bus.publish(EventType.ROLLOUT, ro.to_dict())

    def start_rollout(self, req: RolloutRequest, base_url: str) -> dict:
        """Roll a catalogue image out to ``req.nodes``, the first one as the canary (``POST /api/rollouts``).
        ``base_url``: how nodes reach this fleet (``public_url`` wins). RoundRejected when not possible."""
        if self.images is None:
            raise RoundRejected("this fleet has no image catalogue (start it with an images directory)", 404)
        image = self.images.entry(req.image)
        if image is None:
            raise RoundRejected(f"unknown image {req.image!r}", 404)
        now = self.clock()
        base = (self.settings.public_url or base_url).rstrip("/")
        url = f"{base}/api/images/{image['id']}"  # each stage's command adds its own grant
        ro = self.rollouts.start(req, image=image, url=url, nodes=self.nodes(), now=now)
        self._rollout_changed(ro)
        return ro.to_dict()

    def check_download(self, image_id: str, query: dict[str, str]) -> None:
        """May a request without the operator token download ``image_id``? GrantRefused if not.

        It needs a valid, unexpired grant (``exp``, ``grant``); in a signed swarm also the proof
        (``node``, ``proof``) of a node the running roll-out of this image has sent it to."""
        if self.images is None:
            raise GrantRefused(404, "this fleet has no image catalogue")
        now = self.clock()
        exp = self.images.check_grant(image_id, query.get("exp"), query.get("grant"), now)
        if self._keyring is None:
            return  # unsigned swarm: the grant is a bearer token (short-lived; see PROTOCOL.md)
        node, proof = query.get("node"), query.get("proof")
        if not node or not proof:
            raise GrantRefused(401, "this signed fleet accepts a download grant only with the node's proof "
                                    "(node=, proof=; federation/PROTOCOL.md section 9)")
        if not grants.verify_proof(self._keyring, node, proof, image_id, exp, str(query["grant"])):
            raise GrantRefused(401, f"the proof does not verify with a node key of {node[:64]!r}")
        if not self.rollouts.downloading(image_id, node):
            raise GrantRefused(403, f"no running roll-out is sending image {image_id} to {node}")

    def image_rollback(self, req: ImageRollbackRequest) -> dict:
        """Return ``req.nodes`` to their previous good slot (``POST /api/image-rollback``)."""
        ro = self.rollouts.start_rollback(req, nodes=self.nodes(), now=self.clock())
        self._rollout_changed(ro)
        return ro.to_dict()

    def image_uploaded(self) -> None:
        if self.images is not None:
            self.bus.publish(EventType.IMAGES, {"images": self.images.list()})

    def snapshot(self) -> dict:
        leading, leader = self.leader_address()
        return {"swarm": self.settings.swarm, "role": "leader" if leading else "follower", "leader": leader,
                "nodes": self.nodes(), "rounds": self.round_history(),
                "actions": self.history.actions(50), "margin": self.settings.rollback_margin,
                "auto_rollback": self.settings.auto_rollback, "rollouts": self.rollouts.recent(),
                "images": self.images.list() if self.images is not None else None,
                "enrollments": self.enrollment.list(), "auto_rounds": self.auto_view(),
                "async": self.async_view()}
