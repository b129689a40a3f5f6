"""A benchmark edge node in its own process: ``python -m bench.node_proc ARTIFACT DATA_DIR``.

Serving from a separate process keeps the load generator's threads off the server's GIL, as on a
real board. Prints ``READY <port>`` once uvicorn listens; exits when its stdin closes. With
``--train`` the node trains back-to-back single-member rounds (in-memory transport) on random
samples, so requests are measured while a round is always running; stdin lines ``pause`` and
``train`` switch training off and on, so idle and training can be measured interleaved in the
same process (the load from other jobs on a shared machine then hits both alike).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np

__all__ = ["main"]


def _trainer_loop(node, stop: threading.Event, steps: int, resume: threading.Event,
                  idle: threading.Event) -> None:
    from federation.messages import RoundCommand

    i = 0
    while not stop.is_set():
        if not resume.is_set():  # paused: report idle (no round running) and wait
            idle.set()
            resume.wait(0.1)
            continue
        idle.clear()
        cmd = RoundCommand(round_id=f"bench-{i}", steps=steps, participants=[node.node_id])
        node.start_round(cmd).join()
        i += 1
    print(f"ROUNDS {i} LOSS {node.metrics.last_loss}", file=sys.stderr, flush=True)


def _seed_samples(node, n: int = 512) -> None:
    rng = np.random.default_rng(0)
    inputs = {s.name: rng.standard_normal((n, *s.shape[1:])).astype(s.dtype) for s in node.inputs}
    classes = int(node.outputs[0].shape[-1])
    node.add_samples(inputs, rng.integers(0, classes, n))


def main(argv: list[str] | None = None) -> None:
    """Serve one node until stdin closes (see the module docstring)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path)
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--round-steps", type=int, default=200)
    ap.add_argument("--train-nice", type=int, default=None,
                    help="[training] nice of the node (default: the node's own default)")
    ap.add_argument("--isolation", choices=("process", "thread"), default=None,
                    help="[training] isolation of the node (default: the node's own default)")
    ap.add_argument("--worker-priority", choices=("nice", "idle"), default=None,
                    help="[training] worker_priority of the node (default: the node's own default)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="experiment: sys.setswitchinterval of the node process")
    ap.add_argument("--broker", default=None,
                    help="MQTT broker URL: the node subscribes --stream-topic there (bench.ingest)")
    ap.add_argument("--stream-topic", default=None,
                    help="SenML topic of a 2-channel 1 kHz stream, windows of 32 (digits: 64 inputs)")
    args = ap.parse_args(argv)

    from api.node_app import create_node_app
    from api.serving import ServerThread
    from edgenode.config import NodeConfig
    from edgenode.node import EdgeNode
    from federation.memory import MemoryHub

    training: dict[str, object] = {} if args.train_nice is None else {"nice": args.train_nice}
    if args.isolation is not None:
        training["isolation"] = args.isolation
    if args.worker_priority is not None:
        training["worker_priority"] = args.worker_priority
    settings: dict[str, object] = {"node_id": "bench", "artifact": str(args.artifact),
                                   "data_dir": str(args.data_dir), "port": 0, "training": training}
    if args.broker is not None:
        settings["broker"] = args.broker
    if args.stream_topic is not None:
        settings["streams"] = [{"name": "s", "topic": args.stream_topic, "fields": ["ax", "ay"],
                                "sample_rate_hz": 1000.0, "window": 32, "queue": 100_000}]
    cfg = NodeConfig.from_dict(settings)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    transport = MemoryHub().transport("bench") if args.train else None
    node = EdgeNode(cfg, transport=transport)
    node.start()
    stop = threading.Event()
    trainer = None
    resume, idle = threading.Event(), threading.Event()
    steps: list[int] = []  # steps reported by STEP events (each carries the losses since the last)
    resume.set()
    if args.train:
        _seed_samples(node)
        node.add_event_listener(lambda ev: steps.append(len(ev.losses or [])) if ev.losses else None)
        trainer = threading.Thread(target=_trainer_loop, args=(node, stop, args.round_steps, resume, idle),
                                   daemon=True)
        trainer.start()
    with ServerThread(create_node_app(node)) as srv:
        print(f"READY {srv.port}", flush=True)
        # Control lines: "pause" (finish the running round, then idle) -> "PAUSED <steps trained
        # when the pause arrived>"; "train" -> "TRAINING <steps>"
        # "TRAINING" once a round runs again. EOF (the parent closes stdin) stops the node.
        for line in sys.stdin:
            if line.strip() == "pause":
                trained = sum(steps)  # now, not after the running round finishes
                resume.clear()
                idle.wait(120)
                print(f"PAUSED {trained}", flush=True)
            elif line.strip() == "train":
                resume.set()
                while idle.is_set() and args.train:
                    time.sleep(0.005)
                print(f"TRAINING {sum(steps)}", flush=True)
        stop.set()
        node.stop(timeout=30)
    if trainer is not None:
        trainer.join(30)


if __name__ == "__main__":
    main()
