"""Serve the fleet app with uvicorn: shared by ``fractal fleet`` and the ``deploy.swarm`` launcher.

Lives outside :mod:`api.cli` so deploy/ never imports the CLI.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from api.fleet.errors import FleetError
from api.net import port_problem

if TYPE_CHECKING:
    from api.fleet.settings import FleetSettings

__all__ = ["check_port_free", "serve_fleet", "wait_for_leader"]


def check_port_free(host: str, port: int) -> None:
    """Raise a :class:`FleetError` with a hint if ``host:port`` cannot be listened on."""
    if (problem := port_problem(host, port)) is not None:
        raise FleetError(problem, hint="pick another port with --port")


def wait_for_leader(url: str, timeout_s: float, *, poll_s: float = 0.25) -> bool:
    """A standby's start: wait until the fleet process at ``url`` answers ``/api/health`` as the
    leader, at most ``timeout_s``; True if it did. Both processes of a common start (`compose up`)
    would otherwise race for the lock, and the standby could lead after every fresh start. When the
    other process never leads in time (it failed, or it is down) the standby goes on and contends
    for the lead itself: it is there for availability. Any answer but a leader's (refused
    connection, an error status, a follower) is waited out."""
    import json
    import time
    import urllib.request

    health = url.rstrip("/") + "/api/health"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(health, timeout=min(5.0, max(0.5, timeout_s))) as resp:
                if json.loads(resp.read(4096)).get("role") == "leader":
                    return True
        except (OSError, ValueError, AttributeError):  # not up yet, not a fleet, not JSON
            pass
        if time.monotonic() >= deadline:
            return False
        threading.Event().wait(poll_s)  # the other process's start: nothing here to wait on


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def serve_fleet(settings: FleetSettings, *, ready: Callable[[], object] | None = None) -> None:
    """Run the fleet app with uvicorn in this thread until SIGINT/SIGTERM.

    ``ready`` (optional callable) runs once the server accepts connections.
    """
    import uvicorn

    from api.fleet_app import create_fleet_app

    check_port_free(settings.host, settings.port)
    fleet_app = create_fleet_app(settings)
    fleet_app.state.fleet.start()  # connect now: a bad broker URL fails here with a clear error
    config = uvicorn.Config(fleet_app, host=settings.host, port=settings.port, log_level="warning",
                            timeout_graceful_shutdown=2, lifespan="on")
    server = uvicorn.Server(config)
    lost: list[str] = []

    def lost_lead(why: str) -> None:  # fail-stop (api/fleet/leadership.py): never act beside a new leader
        lost.append(why)
        server.should_exit = True

    fleet_app.state.fleet.on_lost_lead = lost_lead
    if ready is not None:
        notify_ready = ready

        def notify() -> None:
            while not server.started and not server.should_exit:
                threading.Event().wait(0.05)
            if server.started:
                notify_ready()

        threading.Thread(target=notify, daemon=True).start()
    # uvicorn handles SIGINT/SIGTERM, then re-raises the signal once it has shut down: make
    # SIGTERM unwind like Ctrl-C so the MQTT link closes cleanly and the exit code is 0.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if in_main else None
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # the normal way out: Ctrl-C or SIGTERM (see _interrupt)
    finally:
        fleet_app.state.fleet.stop()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    if lost:
        raise FleetError(f"this fleet process stopped leading: {lost[0]}",
                         hint="start it again: it follows, and leads when the lead is free")
    if not server.started:
        raise FleetError(f"the fleet service did not start on {settings.host}:{settings.port}",
                         hint="check the broker URL (--broker) and that the port is free")
