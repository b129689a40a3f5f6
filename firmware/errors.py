"""The firmware layer's error tree: one base with a ``hint`` (printed by the CLI as ``help:``).

FirmwareError
├── ImageError     the image file: not an image, truncated, tampered, bad signature, wrong board
├── DeviceError    the device directory: not provisioned, unknown key, downgrade, locked
└── BootError      the boot supervisor: no bootable slot, health check failed
"""

from __future__ import annotations

from fractal import FractalError

__all__ = ["FirmwareError", "ImageError", "DeviceError", "BootError"]


class FirmwareError(FractalError):
    """Base of every firmware error: a one-line message and an optional fix (under the project's
    root error, so the CLI prints it as one line)."""


class ImageError(FirmwareError):
    """The image file is unusable (format, integrity, signature, board)."""


class DeviceError(FirmwareError):
    """The device directory refuses the operation (trust, version, state)."""


class BootError(FirmwareError):
    """The boot supervisor found no slot it could start."""
