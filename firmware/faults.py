"""Where a test kills the flasher: a :class:`FlashFaults` plan, for tests only.

The plan enters through the call a test makes: ``firmware.device.flash(..., faults=FlashFaults.parse(
"bytes:4096"))``; ``fractal image flash`` passes none (:data:`NO_FLASH_FAULTS`), and nothing in a
production path reads a switch from the environment. Tests that need a real process to die start
``python -m tests.firmware.flashkill --at POINT IMAGE --device DEV`` (tests/firmware/flashkill.py),
which flashes exactly as ``fractal image flash`` does, with that plan.

Points (text form): ``bytes:N`` SIGKILLs the flasher after N payload bytes of the slot are written;
``switch`` right before the boot-state rename that makes the new slot the active one.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from firmware.errors import FirmwareError

__all__ = ["FlashFaults", "NO_FLASH_FAULTS", "die"]


def die() -> None:
    """SIGKILL this process (a power cut, as far as the device can tell)."""
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class FlashFaults:
    kill_after_bytes: int | None = None  # SIGKILL once this many payload bytes are written
    kill_at_switch: bool = False  # SIGKILL right before the boot-state rename

    @classmethod
    def parse(cls, spec: str) -> FlashFaults:
        if spec == "switch":
            return cls(kill_at_switch=True)
        if spec.startswith("bytes:") and spec[6:].isdigit():
            return cls(kill_after_bytes=int(spec[6:]))
        raise FirmwareError(f"unknown flash fault {spec!r}", hint="use bytes:N or switch")

    def cut(self, written: int, chunk: bytes) -> bytes | None:
        """The part of ``chunk`` to write before dying at ``kill_after_bytes``, or None to write it all."""
        if self.kill_after_bytes is None or written + len(chunk) <= self.kill_after_bytes:
            return None
        return chunk[: self.kill_after_bytes - written]


NO_FLASH_FAULTS = FlashFaults()
