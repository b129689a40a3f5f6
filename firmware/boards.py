"""Board presets: which compiled artifacts a board runs.

A board is a target preset of :mod:`compiler.targets` (its arch comes from there). A board runs
an artifact compiled for the board's own preset or for the generic preset of its architecture
(``rpi4`` runs ``rpi4`` and ``aarch64`` artifacts, not ``rpi5`` ones, whose dotprod
instructions a Cortex-A72 lacks).
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.targets import PRESETS
from firmware.errors import ImageError

__all__ = ["Board", "get_board", "BOARDS"]


@dataclass(frozen=True)
class Board:
    name: str
    arch: str
    description: str

    def accepts(self, preset: str) -> bool:
        """True when an artifact compiled for ``preset`` runs on this board."""
        return preset in (self.name, self.arch)


BOARDS: dict[str, Board] = {p.name: Board(p.name, p.arch, p.description) for p in PRESETS.values()}


def get_board(name: str) -> Board:
    """The board called ``name``; ImageError naming the known boards otherwise."""
    try:
        return BOARDS[name]
    except KeyError:
        raise ImageError(f"unknown board {name!r}", hint=f"choose one of: {', '.join(BOARDS)}") from None
