"""The node process a boot started, remembered in the data area so the next boot can deal with it.

``fractal boot`` can die without stopping its node (SIGKILL, a crash): the node is then orphaned
and keeps serving on the board's port. Left alone, it would answer the next boot's health check
in place of the slot being tried. So every boot records ``data/node-process.json`` (the node's
pid and kernel start time, the supervisor's, and the boot id handed to the node) and, before
starting a node, stops a recorded node whose supervisor is gone. The start time (field 22 of
``/proc/PID/stat``) makes a recycled pid harmless: only the very process recorded is signalled.
A node whose supervisor is still alive is another running boot of the same device: refused.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

from firmware.device import Device
from firmware.errors import BootError
from fractal.files import atomic_write

__all__ = ["PROCESS_RECORD", "port_free", "record", "stop_leftover"]

PROCESS_RECORD = "node-process.json"


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid``; None when there is no such process."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[19])


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start and st[0] not in "ZX"  # a zombie has exited


def record(dev: Device, pid: int, boot_id: str) -> None:
    """Remember the node this boot just started (and this supervisor)."""
    me, node = _stat(os.getpid()), _stat(pid)
    rec = {"node_pid": pid, "node_start": node[1] if node else -1, "boot_id": boot_id,
           "supervisor_pid": os.getpid(), "supervisor_start": me[1] if me else -1}
    atomic_write(dev.data / PROCESS_RECORD, json.dumps(rec).encode())


def _wait_gone(pid: int, start: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while _alive(pid, start):
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True


def stop_leftover(dev: Device, log: Callable[[str], None]) -> None:
    """Stop the node an earlier, dead supervisor left running (SIGTERM, then SIGKILL)."""
    path = dev.data / PROCESS_RECORD
    try:
        rec = json.loads(path.read_bytes())
        pid, start = int(rec["node_pid"]), int(rec["node_start"])
        sup, sup_start = int(rec["supervisor_pid"]), int(rec["supervisor_start"])
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError):
        log(f"ignoring an unreadable {PROCESS_RECORD}")
        path.unlink(missing_ok=True)
        return
    if pid <= 0 or pid == os.getpid() or not _alive(pid, start):
        return
    if sup != os.getpid() and _alive(sup, sup_start):
        raise BootError(
            f"the device is already booted by `fractal boot` process {sup} (its node is process {pid})",
            hint="stop that supervisor first; one boot supervisor runs a device at a time",
        )
    log(f"stopping node process {pid}, left running by a supervisor that died")
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        if _wait_gone(pid, start, wait_s):
            break
    else:
        raise BootError(f"the leftover node process {pid} does not stop",
                        hint="stop it by hand, then boot again")
    path.unlink(missing_ok=True)


def port_free(host: str, port: int) -> None:
    """BootError when another process listens on ``host:port`` (bound the way the node binds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return  # e.g. an address this host does not have: the node reports it itself
            raise BootError(
                f"port {port} on {host} is in use by another process; the node this boot starts "
                "could not serve there, and the health check must not talk to anything else",
                hint="stop that process (`ss -ltnp` shows it) or boot with another --port",
            ) from None
