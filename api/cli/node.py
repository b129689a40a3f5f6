"""`fractal node --config NODE.toml`: one edge node (agent + HTTP API) in this process."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer

from api.cli import app
from api.cli.net import port_problem
from edgenode.common import freeze_startup_heap
from edgenode.errors import NodeError

if TYPE_CHECKING:
    from edgenode.config import NodeConfig
    from edgenode.node import EdgeNode

__all__ = ["node", "serve_node"]


def _check_port_free(host: str, port: int) -> None:
    if (problem := port_problem(host, port)) is not None:
        raise NodeError(problem, hint="change `port` (or `host`) in NODE.toml")


def serve_node(config_path: Path, *, log_level: str = "info",
               build: Callable[[NodeConfig], EdgeNode] | None = None) -> int:
    """Load the config, build and start the EdgeNode, serve its API with uvicorn until SIGINT/SIGTERM.

    ``build``: how the node is made from its config (default ``EdgeNode(config)``; a test's entry
    point passes one that injects faults, tests/edgenode/faultnode.py).

    Returns the exit code: 0, or ``firmware.boot.REBOOT_EXIT_CODE`` when the node staged an image
    update (or an image rollback) and its boot supervisor should start the other slot."""
    from edgenode.config import load_config

    cfg = load_config(config_path)  # ConfigError -> one line, exit 1 (api.cli.main)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from edgenode.enrol import enrolled_config

    cfg = enrolled_config(cfg)  # first boot of a flashed board: enrol with the fleet (edgenode/enrol.py)
    _check_port_free(cfg.host, cfg.port)
    try:
        from api.node_app import create_node_app
    except ImportError as exc:
        raise NodeError(f"the node HTTP API is not available ({exc})",
                        hint="install the full fractal-edge package (api/node_app.py)") from None
    import uvicorn

    from edgenode.node import EdgeNode

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = (build or EdgeNode)(cfg)
    # cast: NodeLike declares plain attributes, EdgeNode exposes read-only properties
    server = uvicorn.Server(uvicorn.Config(create_node_app(cast(Any, node)), host=cfg.host, port=cfg.port,
                                           log_level="warning", timeout_graceful_shutdown=2))
    node.start()  # connect to the broker now: a bad broker fails before we listen
    freeze_startup_heap()  # no full-GC pause of the start-up heap in the middle of a round

    def reboot_when_asked() -> None:
        node.reboot_requested.wait()
        server.should_exit = True

    threading.Thread(target=reboot_when_asked, name="reboot-watch", daemon=True).start()
    try:
        server.run()
        if not server.started:
            raise NodeError(f"the node API did not start on {cfg.host}:{cfg.port}",
                            hint="is the port free? change `port` in NODE.toml")
    finally:
        node.stop()
    if node.reboot_requested.is_set():
        from firmware.boot import REBOOT_EXIT_CODE

        logging.getLogger("fractal.node").info("restarting into the new slot (exit %d)", REBOOT_EXIT_CODE)
        return REBOOT_EXIT_CODE
    return 0


@app.command("node")
def node(
    config: Path = typer.Option(..., "--config", "-c", help="Path to NODE.toml (see edgenode/config.py)."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Run one edge node: inference + samples over HTTP, training rounds over MQTT."""
    code = serve_node(config, log_level=log_level)
    if code:
        raise typer.Exit(code)
