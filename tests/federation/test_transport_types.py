"""What a transport or link can do is part of its type (issue 27, STYLE.md item 13).

* Every transport class in federation/ and edgenode/ is one of the classes checked here, satisfies
  :class:`~federation.transport.Transport` and declares its :class:`Capabilities`, and its push
  capability is what ``set_receiver`` does (push: payloads reach the receiver; no push: refused).
* Every publish/subscribe link is a :class:`~federation.transport.PubSubLink` (the one Protocol of
  the fleet, the node, SignedLink and MqttTransport): checked by mypy (``_static`` below; this file
  is in ``make check``'s mypy list) and by a test that runs mypy on this file.
* No module of federation/ or edgenode/ probes an object with ``getattr``/``hasattr`` to learn
  what it is, outside a short list of reviewed uses.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import edgenode
import federation
from edgenode.faults import NO_FAULTS, FaultyTransport
from edgenode.trainworker import _RelayTransport
from federation.errors import TransportError
from federation.framing import FrameKind, Phase, decode, encode
from federation.linkmodel import LinkModel, Network
from federation.memory import MemoryHub, MemoryTransport, SimHub, SimTransport
from federation.mqtt import MqttLink
from federation.mqtt_transport import MqttTransport
from federation.session import Endpoint
from federation.signed import SignedLink
from federation.transport import Capabilities, Framing, PubSubLink, Transport
from tests.fleet.fake_link import FakeLink

ROOT = Path(__file__).parents[2]
TRANSPORTS = {MemoryTransport, MqttTransport, _RelayTransport, FaultyTransport, SimTransport}


def _static(mqtt: MqttLink, signed: SignedLink, fake: FakeLink, hub: MemoryHub) -> None:
    """Never called: mypy checks that each implementation satisfies its Protocol."""
    links: list[PubSubLink] = [mqtt, signed, fake]
    transports: list[Transport] = [mqtt.transport("a"), signed.transport("a"), fake.transport("a"),
                                   hub.transport("a"), FaultyTransport(hub.transport("b"), NO_FAULTS),
                                   _RelayTransport("a", 1024, lambda msg: None),
                                   SimHub(Network(LinkModel())).transport("a")]
    print(links, transports)


def _transport_classes() -> set[type]:
    """Every class in federation/ and edgenode/ with the Transport methods (send, recv, close)."""
    found = set()
    for pkg in (federation, edgenode):
        for mod in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            if mod.name.endswith("_gmac"):
                continue
            module = importlib.import_module(mod.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if (cls.__module__ == mod.name and all(m in vars(cls) for m in ("send", "recv", "close"))
                        and cls is not Transport):
                    found.add(cls)
    return found


def test_every_transport_class_is_checked_here() -> None:
    assert _transport_classes() == TRANSPORTS


def _frame(sender: str) -> bytes:
    return bytes(encode(FrameKind.DATA, Phase.REDUCE_SCATTER, swarm="default", tag="t", sender=sender,
                        payload=[]))


def test_polled_transports_declare_no_push_and_refuse_a_receiver() -> None:
    hub = MemoryHub()
    sent: list[tuple[Any, ...]] = []
    made: list[Transport] = [hub.transport("a"), FaultyTransport(hub.transport("b"), NO_FAULTS),
            _RelayTransport("c", 1024, sent.append, framing=Framing(authenticated=True, crc=False, room=40))]
    for t in made:
        assert isinstance(t, Transport)
        assert isinstance(t.capabilities, Capabilities) and not t.capabilities.push, t
        with pytest.raises(TransportError, match="does not push"):
            t.set_receiver(lambda p: None)
    assert made[2].capabilities.framing == Framing(authenticated=True, crc=False, room=40)
    # the polled ones still deliver through recv
    made[1].send("a", _frame("b"))
    assert decode(made[0].recv(2.0) or b"").sender == "b"


def test_fault_wrapper_keeps_the_inner_transports_framing() -> None:
    link = FakeLink()
    link.framing = Framing(authenticated=True, crc=False, room=56)  # as a SignedLink with ring MACs
    inner = MqttTransport(link, "b")
    assert FaultyTransport(inner, NO_FAULTS).capabilities.framing == Framing(authenticated=True, crc=False,
                                                                            room=56)


@pytest.mark.parametrize("framing", [Framing(), Framing(authenticated=True), Framing(authenticated=True,
                                                                                       crc=False, room=48)])
def test_mqtt_transport_takes_its_links_framing_and_pushes(framing: Framing) -> None:
    link = FakeLink()
    link.framing = framing
    a, b = MqttTransport(link, "a"), MqttTransport(link, "b")
    assert isinstance(a, Transport) and a.capabilities == Capabilities(framing=framing, push=True)
    got: list[bytes] = []
    done = threading.Event()

    def receive(payload: bytes) -> None:
        got.append(bytes(payload))
        done.set()

    b.set_receiver(receive)
    frame = encode(FrameKind.DATA, Phase.REDUCE_SCATTER, swarm="default", tag="t", sender="a",
                   payload=[], crc=framing.crc, room=framing.room)
    a.send("b", frame)
    assert done.wait(2.0)
    assert decode(got[0], check_crc=not framing.authenticated).sender == "a"


def test_the_session_follows_the_declared_capabilities() -> None:
    link = FakeLink()
    link.framing = Framing(authenticated=True, crc=False, room=48)
    pushed = Endpoint(MqttTransport(link, "a"))
    polled = Endpoint(MemoryHub().transport("a"))
    try:
        assert pushed.frame_kw == {"crc": False, "room": 48} and not pushed.check_crc
        assert pushed._thread is None  # frames arrive on the transport's thread, no pump
        assert polled.frame_kw == {"crc": True, "room": 0} and polled.check_crc
        assert polled._thread is not None and polled._thread.is_alive()
    finally:
        pushed.close()
        polled.close()


def test_framing_without_crc_must_be_authenticated() -> None:
    with pytest.raises(ValueError, match="authenticated"):
        Framing(crc=False)
    with pytest.raises(ValueError, match="room"):
        Framing(room=-1)


def test_links_satisfy_the_one_pubsub_protocol_for_mypy() -> None:
    """Runs mypy on this file: ``_static`` assigns every link and transport to its Protocol."""
    p = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                        "--disallow-untyped-defs", __file__], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr


# (file, function) -> why a getattr/hasattr there is no probe of what an object is
ALLOWED_PROBES = {
    ("federation/stats.py", "add"): "a dataclass's own counter fields, by name",
    ("federation/stats.py", "snapshot"): "a dataclass's own fields, by name",
    ("federation/ringmac.py", "_direction_key"): "the C MAC backend's speed (not a transport)",
    ("edgenode/rounds.py", "_lower_thread_priority"): "a platform feature of the os module",
}


def _probes() -> set[tuple[str, str]]:
    found = set()
    for pkg in ("federation", "edgenode"):
        for path in sorted((ROOT / pkg).glob("*.py")):
            tree = ast.parse(path.read_text())
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                            and node.func.id in ("getattr", "hasattr")):
                        found.add((f"{pkg}/{path.name}", fn.name))
    return found


def test_no_code_probes_an_object_to_learn_what_it_is() -> None:
    probes = _probes()
    assert probes <= set(ALLOWED_PROBES), sorted(probes - set(ALLOWED_PROBES))
