"""A benchmark edge node in its own process: ``python -m api.benchmarks.node_proc ARTIFACT DATA_DIR``.

Serving from a separate process keeps the load generator's threads off the server's GIL, as on a
real board. Prints ``READY <port>`` once uvicorn listens; exits when its stdin closes. With
``--train`` the node trains back-to-back single-member rounds (in-memory transport) on random
samples for its whole life, so requests are measured while a round is always running.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import numpy as np

__all__ = ["main"]


def _trainer_loop(node, stop: threading.Event, steps: int) -> None:
    from federation.messages import RoundCommand

    i = 0
    while not stop.is_set():
        cmd = RoundCommand(round_id=f"bench-{i}", steps=steps, participants=[node.node_id])
        node.start_round(cmd).join()
        i += 1
    print(f"ROUNDS {i} LOSS {node.metrics.last_loss}", file=sys.stderr, flush=True)


def _nice_round_worker(node, nice: int) -> None:
    """Wrap the node's round worker so its thread (and the TVM pool it creates) runs at ``nice``.

    An experiment knob, not what the node does: Linux threads have their own nice value and new
    threads inherit it, so this deprioritises training without touching the inference threads.
    """
    import os

    inner = node._round_worker

    def niced(cmd):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        inner(cmd)

    node._round_worker = niced


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
    ap.add_argument("--train-nice", type=int, default=0,
                    help="experiment: run the round worker (and the TVM threads it spawns) at this nice")
    args = ap.parse_args(argv)

    from api.node_app import create_node_app
    from api.serving import ServerThread
    from edgenode.config import NodeConfig
    from edgenode.node import EdgeNode
    from federation.memory import MemoryHub

    cfg = NodeConfig(node_id="bench", artifact=args.artifact, data_dir=args.data_dir, port=0)
    transport = MemoryHub().transport("bench") if args.train else None
    node = EdgeNode(cfg, transport=transport)
    if args.train_nice:
        _nice_round_worker(node, args.train_nice)
    node.start()
    stop = threading.Event()
    trainer = None
    if args.train:
        _seed_samples(node)
        trainer = threading.Thread(target=_trainer_loop, args=(node, stop, args.round_steps), daemon=True)
        trainer.start()
    with ServerThread(create_node_app(node)) as srv:
        print(f"READY {srv.port}", flush=True)
        sys.stdin.read()  # the parent closes our stdin to stop us
        stop.set()
        node.stop(timeout=30)
    if trainer is not None:
        trainer.join(30)


if __name__ == "__main__":
    main()
