"""The firmware layer's error tree: one base with a ``hint`` (printed by the CLI as ``help:``).

FirmwareError
├── ImageError     the image file: not an image, truncated, tampered, bad signature, wrong board
├── DeviceError    the device directory: not provisioned, unknown key, downgrade, locked
└── BootError      the boot supervisor: health check failed, device busy, port taken
    └── NoBootableSlot   no slot may boot (none verifies or passes, all below the rollback floor)
"""

from __future__ import annotations

from fractal import FractalError

__all__ = ["FirmwareError", "ImageError", "DeviceError", "BootError", "NoBootableSlot"]


class FirmwareError(FractalError):
    """Base of every firmware error: a one-line message and an optional fix (``hint``)."""


class ImageError(FirmwareError):
    """The image file is unusable (format, integrity, signature, board)."""


class DeviceError(FirmwareError):
    """The device directory refuses the operation (trust, version, state)."""


class BootError(FirmwareError):
    """The boot supervisor found no slot it could start."""


class NoBootableSlot(BootError):
    """No slot may boot: nothing was started and the boot state's ``halt`` says why."""
