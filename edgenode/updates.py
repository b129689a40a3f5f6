"""Image updates of an edge node: the fleet's ImageUpdateCommand / ImageRollbackCommand in, the
device's image in every status out. Mixed into :class:`edgenode.node.EdgeNode`.

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
from typing import TYPE_CHECKING

from edgenode.common import SeenIds, get_logger
from edgenode.ports import Publication, Updater
from federation.messages import ImageInfo, ImageRollbackCommand, ImageUpdateCommand
from fractal import FractalError

if TYPE_CHECKING:
    from edgenode.security import NodeAuth

if TYPE_CHECKING:
    from edgenode.config import NodeConfig

__all__ = ["ImageControl", "COMMANDS_SEEN_KEPT"]

log = get_logger("agent")

COMMANDS_SEEN_KEPT = 256
_COMMANDS_SEEN_FILE = "commands-seen.json"  # in the node's data dir, beside rounds-seen.json


class ImageControl:
    """The node provides ``node_id``, ``updater``, ``publish_status`` and ``round_busy``."""

    updater: Updater | None
    reboot_requested: threading.Event
    _update_thread: threading.Thread | None
    _stopping: threading.Event
    _commands_seen: SeenIds | None = None

    if TYPE_CHECKING:  # provided by EdgeNode / RoundControl (declared only for the type checker:
        # a runtime stub here would shadow them, this class comes first in EdgeNode's bases)
        auth: NodeAuth | None
        config: NodeConfig

        @property
        def node_id(self) -> str: ...

        def publish_status(self) -> Publication | None: ...

        def round_busy(self) -> bool: ...

    def first_time(self, command_id: str) -> bool:
        """True the first time this node sees ``command_id`` (then remembered durably, across
        restarts): no signed command (image update, image rollback, model rollback) runs twice,
        however often it is replayed."""
        if self._commands_seen is None:
            self._commands_seen = SeenIds(self.config.data_dir / _COMMANDS_SEEN_FILE, COMMANDS_SEEN_KEPT)
        if command_id in self._commands_seen:
            log.info("ignoring repeated command %s (already acted on)", command_id)
            return False
        self._commands_seen.add(command_id)
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

    def handle_image_command(self, cmd: ImageUpdateCommand | ImageRollbackCommand) -> None:
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
        if not self.first_time(uid):  # QoS 1 redelivery, or a replay (also after a restart)
            return
        why = None
        info = self.image_info()
        if info is None or info.health != "passed":
            why = "the node's own boot health check has not passed yet"
        elif self.round_busy():
            why = "busy with a training round"
        elif self._update_thread is not None and self._update_thread.is_alive():
            why = "another image update is in progress"
        if why is not None:
            self.updater.fail(uid, kind, version, why)
            self.publish_status()
            return
        self.updater.begin(uid, kind, version)
        self.publish_status()
        self._update_thread = threading.Thread(target=self._run_image_command, args=(cmd,),
                                               name=f"image-{uid}", daemon=True)
        self._update_thread.start()

    def _download_url(self, cmd: ImageUpdateCommand) -> str:
        """The command's URL; in a signed swarm with the node's proof for its grant (the fleet
        accepts a grant only from a node it sent it to: federation/grants.py)."""
        if self.auth is None:
            return cmd.url
        from federation.grants import prove_url  # lazy: `cryptography` only for signed swarms

        return prove_url(cmd.url, cmd.image_id, self.auth.identity.signer)

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
            self.publish_status()
            return
        pub = self.publish_status()  # "rebooting": the fleet sees it before the node goes
        if pub is not None:
            try:
                pub.wait_for_publish(timeout=2.0)
            except Exception:  # noqa: BLE001 - the status after the restart says it anyway
                pass
        self.reboot_requested.set()
