"""A training round runs at a lower Linux priority (``[training] nice``) than inference."""

from __future__ import annotations

import os
import threading

from federation.memory import MemoryHub
from federation.messages import EventKind, RoundCommand


def _round_thread_nice(node_factory, digits_artifact, digits_data, **training) -> tuple[int, int]:
    """(nice of the round worker thread during a step, nice of the calling thread afterwards)."""
    node = node_factory("prio", digits_artifact, transport=MemoryHub().transport("prio"),
                        **({"training": training} if training else {}))
    x, y = digits_data
    node.add_samples({"x": x[:64]}, y[:64])
    seen: list[int] = []

    def listener(ev):  # events are emitted on the round worker thread
        if ev.kind == EventKind.STEP:
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    node.add_event_listener(listener)
    node.start_round(RoundCommand(round_id="r-prio", steps=2, participants=["prio"])).join(60)
    assert seen, "no STEP event"
    assert node.infer({"x": x[:1]})["logits"].shape == (1, 10)
    return seen[-1], os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_round_worker_is_niced_by_default_and_inference_is_not(node_factory, digits_artifact, digits_data):
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker, caller = _round_thread_nice(node_factory, digits_artifact, digits_data)
    assert worker == max(base, 10)
    assert caller == base  # only the worker thread changed, not the process or this thread


def test_nice_zero_keeps_training_at_inference_priority(node_factory, digits_artifact, digits_data):
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker, _ = _round_thread_nice(node_factory, digits_artifact, digits_data, nice=0)
    assert worker == base


def test_threads_started_by_the_worker_inherit_its_nice():
    """Why niceing the worker is enough: TVM's pool threads are created from it and inherit."""
    from edgenode.rounds import _lower_thread_priority

    got: list[int] = []

    def child():
        got.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    def worker():
        _lower_thread_priority(7)
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert got == [max(7, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))]
