"""Small network helpers shared by everything that serves HTTP (CLI verbs, deploy launchers)."""

from __future__ import annotations

import socket

__all__ = ["port_problem"]


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or None if it can.

    uvicorn reports a busy port with a log line and ``sys.exit(1)``; the verbs check first so
    the user gets the CLI's one-line error with a hint instead.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None
