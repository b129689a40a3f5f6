"""The TVM RPC server a board runs so that MetaSchedule on a host can time candidates on it.

    python3 -m compiler.rpc_server --host 0.0.0.0 --port 9190      # on the board (or: fractal rpc-server)
    fractal tune MODEL.onnx --target rpi4 --rpc BOARD:9190          # on the host

Needs only the ``tvm`` wheel (and this package) on the board, like :mod:`compiler.runner`.
``python -m tvm.exec.rpc_server`` does the same job on a board with the wheel's ``[rpc]`` extras,
but it starts the server in a child interpreter (``PopenWorker``: a new ``exec`` of
``sys.executable``), which needs cloudpickle and fails under qemu-user without binfmt_misc (how
this project emulates a board). Here the listening loop runs in this process; each session is
forked by TVM's server (``multiprocessing``, fork: no exec), so it also runs as
``qemu-aarch64 -L SYSROOT SYSROOT/usr/bin/python3.11 -m compiler.rpc_server``.

Security: an RPC server runs any code a client uploads. Bind it to a private network (the
default host is 127.0.0.1) and stop it after tuning.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["serve", "main"]

READY = "fractal rpc-server: listening on"  # the line a supervisor (or a test) waits for


def serve(host: str = "127.0.0.1", port: int = 9190, port_end: int | None = None, key: str = "") -> None:
    """Listen on ``host:port`` (the first free port up to ``port_end``) until killed."""
    from tvm.rpc.server import PopenRPCServerState

    state = PopenRPCServerState(host, port, port_end or port + 1, key=key, silent=True)
    print(f"{READY} {host}:{state.port}", flush=True)
    state.thread.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m compiler.rpc_server", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=9190)
    ap.add_argument("--port-end", type=int, default=None, help="try ports up to this one (exclusive)")
    args = ap.parse_args(argv)
    try:
        serve(args.host, args.port, args.port_end)
    except (OSError, ValueError) as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc} (help: choose another --port)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
