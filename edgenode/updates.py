"""Image updates of an edge node: the fleet's ImageUpdateCommand / ImageRollbackCommand in, the
device's image in every status out. :class:`edgenode.node.EdgeNode` holds one (``node.images``).

An update runs on its own thread: record ``downloading``, download + verify + flash into the
inactive slot (:class:`edgenode.ports.Updater`, ``firmware.ota.DeviceUpdates``), then set
:attr:`reboot_requested`. The process that serves the node (``fractal node``) exits with the boot
supervisor's reboot code when it sees it, and ``fractal boot`` starts the new slot, health-checks
it and marks it good or falls back. The outcome reaches the fleet in the next status: the record
in the data area survives the restart, and is read together with the boot state.

A refusal (no device, busy with a round or another update, download or verification failed)
changes nothing but the record (``failed`` with the reason), which the status reports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from edgenode.common import SeenIds, get_logger
from edgenode.ports import Publication, Updater
from federation.messages import ImageInfo, ImageRollbackCommand, ImageUpdateCommand
from fractal import FractalError

if TYPE_CHECKING:
    from federation.auth import Signer

__all__ = ["ImageControl", "CommandLog", "COMMANDS_SEEN_KEPT"]

log = get_logger("agent")

COMMANDS_SEEN_KEPT = 256
_COMMANDS_SEEN_FILE = "commands-seen.json"  # in the node's data dir, beside rounds-seen.json


class CommandLog:
    """The signed commands (image update, image rollback, model rollback) this node acted on,
    kept durably in its data directory: no such command runs twice, however often it is
    replayed, also across restarts."""

    def __init__(self, data_dir: Path) -> None:
        self._path = data_dir / _COMMANDS_SEEN_FILE
        self._seen: SeenIds | None = None  # read at the first command

    def first_time(self, command_id: str) -> bool:
        """True the first time ``command_id`` is seen (then remembered)."""
        if self._seen is None:
            self._seen = SeenIds(self._path, COMMANDS_SEEN_KEPT)
        if command_id in self._seen:
            log.info("ignoring repeated command %s (already acted on)", command_id)
            return False
        self._seen.add(command_id)
        return True


class ImageControl:
    """Image updates and rollbacks of the device the node runs from, one at a time.

    ``updater``: the device (None: the node was not booted from one, every command is refused);
    ``signer``: the node's key in a signed swarm (it proves the download grant);
    ``round_busy``: whether a training round runs (an update waits for none);
    ``publish_status``: tell the fleet (the status carries :meth:`image_info`)."""

    def __init__(self, node_id: str, updater: Updater | None, *, commands: CommandLog,
                 publish_status: Callable[[], Publication | None], round_busy: Callable[[], bool],
                 signer: Signer | None = None) -> None:
        self.node_id = node_id
        self.updater = updater
        self.commands = commands
        self.signer = signer
        self._publish_status = publish_status
        self._round_busy = round_busy
        self.reboot_requested = threading.Event()  # set when a staged image waits for a restart
        self._update_thread: threading.Thread | None = None

    def wait_idle(self, timeout: float) -> bool:
        """Block until no update runs (True) or ``timeout`` passes (False)."""
        t = self._update_thread
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    def image_info(self) -> ImageInfo | None:
        """The device image this node runs from, for its status (None when not booted from one)."""
        if self.updater is None:
            return None
        try:
            report = self.updater.report()
            return None if report is None else ImageInfo.model_validate(report)
        except Exception as exc:  # noqa: BLE001 - a damaged record must not stop the status
            log.warning("cannot report the device image: %s", exc)
            return None

    def handle(self, cmd: ImageUpdateCommand | ImageRollbackCommand) -> None:
        """Start an image update / rollback addressed to this node (non-blocking)."""
        if self.node_id not in cmd.nodes:
            return
        is_update = isinstance(cmd, ImageUpdateCommand)
        uid = cmd.update_id if isinstance(cmd, ImageUpdateCommand) else cmd.rollback_id
        kind = "update" if is_update else "rollback"
        version = cmd.version if isinstance(cmd, ImageUpdateCommand) else ""
        if self.updater is None:
            log.warning("image %s %s refused: this node was not booted from a device", kind, uid)
            return  # nothing to record on; the fleet refuses nodes without an image before it asks
        if not self.commands.first_time(uid):  # QoS 1 redelivery, or a replay (also after a restart)
            return
        why = None
        info = self.image_info()
        if info is None or info.health != "passed":
            why = "the node's own boot health check has not passed yet"
        elif self._round_busy():
            why = "busy with a training round"
        elif self._update_thread is not None and self._update_thread.is_alive():
            why = "another image update is in progress"
        if why is not None:
            self.updater.fail(uid, kind, version, why)
            self._publish_status()
            return
        self.updater.begin(uid, kind, version)
        self._publish_status()
        self._update_thread = threading.Thread(target=self._run_image_command, args=(cmd,),
                                               name=f"image-{uid}", daemon=True)
        self._update_thread.start()

    def _download_url(self, cmd: ImageUpdateCommand) -> str:
        """The command's URL; in a signed swarm with the node's proof for its grant (the fleet
        accepts a grant only from a node it sent it to: federation/grants.py)."""
        if self.signer is None:
            return cmd.url
        from federation.grants import prove_url  # lazy: `cryptography` only for signed swarms

        return prove_url(cmd.url, cmd.image_id, self.signer)

    def _run_image_command(self, cmd: ImageUpdateCommand | ImageRollbackCommand) -> None:
        assert self.updater is not None
        url = ""
        try:
            if isinstance(cmd, ImageUpdateCommand):
                log.info("image update %s: downloading version %s from %s", cmd.update_id, cmd.version,
                         cmd.url.split("?")[0])
                url = self._download_url(cmd)
                stats = self.updater.update(cmd.update_id, url, cmd.image_id, max_bytes=cmd.size)
                log.info("image update %s: %d bytes in %d request(s), staged", cmd.update_id,
                         stats.bytes_received, stats.requests)
            else:
                res = self.updater.rollback(cmd.rollback_id)
                log.info("image rollback %s: slot %s (version %s) is active again", cmd.rollback_id,
                         res["slot"], res["version"])
        except Exception as exc:  # noqa: BLE001 - every refusal is reported, the node keeps serving
            uid = cmd.update_id if isinstance(cmd, ImageUpdateCommand) else cmd.rollback_id
            kind = "update" if isinstance(cmd, ImageUpdateCommand) else "rollback"
            version = cmd.version if isinstance(cmd, ImageUpdateCommand) else ""
            # The reason goes out in the node's status, on the broker: never with the grant or the
            # proof in it (an error may quote the URL).
            why = f"{exc} (help: {exc.hint})" if isinstance(exc, FractalError) and exc.hint else str(exc)
            if isinstance(cmd, ImageUpdateCommand):
                for secret in (url, cmd.url):
                    if secret:
                        why = why.replace(secret, cmd.url.split("?")[0])
            log.warning("image %s %s failed: %s", kind, uid, why)
            self.updater.fail(uid, kind, version, why)
            self._publish_status()
            return
        pub = self._publish_status()  # "rebooting": the fleet sees it before the node goes
        if pub is not None:
            try:
                pub.wait_for_publish(timeout=2.0)
            except Exception:  # noqa: BLE001 - the status after the restart says it anyway
                pass
        self.reboot_requested.set()
