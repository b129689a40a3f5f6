"""The device's boot state as types: the slots' states, the table of what may follow what, and the
transitions (flash, trial spent, passed, failed, rollback, halt) in one place.

Stored as ``data/boot-state.json`` (format 1, unchanged: :meth:`BootState.to_json` writes the
same keys the untyped dict had, :meth:`BootState.from_json` reads them and refuses anything else).
Every change of a slot's state goes through :meth:`BootState.set_slot_state`, which checks it
against :data:`TRANSITIONS`::

    empty ──flash──> writing ──written+verified──> trial ──passed──> good
                        ^                            │                │
                        │                            └─failed─> bad <─┘ (files no longer verify,
                        └──── flash (inactive slot: good, trial or bad)     below the floor)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SLOTS", "STATE_FORMAT", "DEFAULT_TRIALS", "SlotState", "Health", "TRANSITIONS", "SlotRecord",
           "BootState", "BadTransition", "other"]

SLOTS = ("a", "b")
STATE_FORMAT = 1
DEFAULT_TRIALS = 3


class SlotState(enum.StrEnum):
    EMPTY = "empty"
    WRITING = "writing"  # being flashed: never booted
    TRIAL = "trial"  # flashed and verified, boots on trial until it passes its health check
    GOOD = "good"  # passed its health check
    BAD = "bad"  # failed (check, trials used up, files, floor): never booted again


class Health(enum.StrEnum):
    """This boot's health check, as a running node reports it."""

    NONE = ""
    PENDING = "pending"
    PASSED = "passed"
    HALTED = "none"  # no slot was started


# What may follow what. A flash may rewrite any slot but the running one (the device refuses to
# overwrite the only good fallback elsewhere); a good slot turns bad when its files stop verifying
# or it falls below the anti-rollback floor.
# An empty or half-written slot named active (a damaged state) is never booted: it turns bad.
TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    SlotState.EMPTY: frozenset({SlotState.WRITING, SlotState.BAD}),
    SlotState.WRITING: frozenset({SlotState.WRITING, SlotState.TRIAL, SlotState.BAD}),
    SlotState.TRIAL: frozenset({SlotState.GOOD, SlotState.BAD, SlotState.WRITING}),
    SlotState.GOOD: frozenset({SlotState.BAD, SlotState.WRITING}),
    SlotState.BAD: frozenset({SlotState.WRITING}),
}


class BadTransition(ValueError):
    """A change of slot state the table does not allow (a bug, never user input)."""


def other(slot: str) -> str:
    return "b" if slot == "a" else "a"


@dataclass
class SlotRecord:
    """One slot: its state and, once flashed, what it holds."""

    state: SlotState = SlotState.EMPTY
    version: str | None = None
    rollback_index: int = 0
    signer: str | None = None
    artifact: str | None = None
    board: str | None = None
    # Keys the slot's image asks the device to trust: trusted once it passed its check.
    pending_keys: list[str] = field(default_factory=list)
    problem: str | None = None  # why it is bad

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state.value}
        if self.version is not None:
            out.update(version=self.version, rollback_index=self.rollback_index, signer=self.signer,
                       artifact=self.artifact, board=self.board)
            if self.state in (SlotState.TRIAL, SlotState.WRITING) or self.pending_keys:
                out["pending_keys"] = list(self.pending_keys)
        if self.problem is not None:
            out["problem"] = self.problem
        return out

    @classmethod
    def from_json(cls, d: Any) -> SlotRecord:
        if not isinstance(d, dict):
            raise ValueError("a slot record is not an object")
        keys = d.get("pending_keys", [])
        index = d.get("rollback_index", 0)
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("pending_keys is not a list of strings")
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError("rollback_index is not an integer")

        def opt(k: str) -> str | None:
            v = d.get(k)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{k} is not a string")
            return v

        return cls(SlotState(str(d.get("state"))), opt("version"), index, opt("signer"), opt("artifact"),
                   opt("board"), list(keys), opt("problem"))


@dataclass
class BootState:
    """``data/boot-state.json``: which slot boots, the trials left, the anti-rollback floor."""

    board: str
    arch: str
    active: str | None = None
    previous: str | None = None  # the good slot to fall back to while ``active`` is unconfirmed
    booted: str | None = None
    trials_left: int = 0
    trials_max: int = DEFAULT_TRIALS
    rollback_floor: int = 0
    slots: dict[str, SlotRecord] = field(default_factory=lambda: {s: SlotRecord() for s in SLOTS})
    health: Health = Health.NONE
    halt: str | None = None  # why no slot may boot (nothing started)

    # -- (de)serialisation ---------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format_version": STATE_FORMAT, "board": self.board, "arch": self.arch, "active": self.active,
            "previous": self.previous, "booted": self.booted, "trials_left": self.trials_left,
            "trials_max": self.trials_max, "rollback_floor": self.rollback_floor,
            "slots": {s: r.to_json() for s, r in self.slots.items()},
        }
        if self.health is not Health.NONE:
            out["health"] = self.health.value
        if self.halt is not None:
            out["halt"] = self.halt
        return out

    @classmethod
    def from_json(cls, d: Any) -> BootState:
        """The state of a parsed ``boot-state.json``; ValueError (or KeyError/TypeError) when it is
        not one."""
        if not isinstance(d, dict) or d.get("format_version") != STATE_FORMAT:
            raise ValueError("unknown boot state format")
        slots = d["slots"]
        if not isinstance(slots, dict) or set(slots) != set(SLOTS):
            raise ValueError("the boot state does not list slots a and b")
        st = cls(
            board=str(d["board"]), arch=str(d["arch"]), active=_slot_or_none(d.get("active")),
            previous=_slot_or_none(d.get("previous")), booted=_slot_or_none(d.get("booted")),
            trials_left=_int(d.get("trials_left", 0)), trials_max=_int(d.get("trials_max", DEFAULT_TRIALS)),
            rollback_floor=_int(d.get("rollback_floor", 0)),
            slots={s: SlotRecord.from_json(slots[s]) for s in SLOTS},
            health=Health(d.get("health", "")), halt=d.get("halt"),
        )
        if st.halt is not None and not isinstance(st.halt, str):
            raise ValueError("halt is not a string")
        return st

    # -- queries -------------------------------------------------------------------------------

    def slot(self, name: str) -> SlotRecord:
        return self.slots[name]

    def good_fallback(self) -> str | None:
        """The previous slot, when it is good (what a rollback or a fallback returns to)."""
        prev = self.previous
        return prev if prev is not None and self.slots[prev].state is SlotState.GOOD else None

    # -- transitions ---------------------------------------------------------------------------

    def set_slot_state(self, name: str, new: SlotState) -> None:
        old = self.slots[name].state
        if new not in TRANSITIONS[old]:
            raise BadTransition(f"slot {name}: {old.value} -> {new.value} is not a transition")
        self.slots[name].state = new

    def begin_write(self, target: str) -> None:
        """A flash starts writing ``target`` (never bootable half-written)."""
        self.set_slot_state(target, SlotState.WRITING)
        self.slots[target] = SlotRecord(SlotState.WRITING)
        if self.previous == target:
            self.previous = None

    def switch_to_trial(self, target: str, record: SlotRecord, trials: int) -> None:
        """The flash wrote and verified ``target``: it boots next, on trial."""
        self.set_slot_state(target, SlotState.TRIAL)
        active = self.active
        self.slots[target] = record
        self.previous = active if active is not None and self.slots[active].state is SlotState.GOOD else None
        self.active = target
        self.halt = None
        self.trials_left = self.trials_max = trials

    def start(self, slot: str) -> None:
        """``slot`` is being started now; a trial slot spends one trial first."""
        if self.slots[slot].state is SlotState.TRIAL:
            self.trials_left -= 1
        self.booted = slot
        self.health = Health.PENDING
        self.halt = None

    def passed(self, slot: str) -> list[str]:
        """``slot`` passed its health check: a trial slot is good and the floor rises to its index.
        Returns the keys its image adds, to be trusted now; they stay pending in the record until
        :meth:`keys_trusted` (a crash in between trusts them at the next good boot, never loses them)."""
        self.health = Health.PASSED
        rec = self.slots[slot]
        if rec.state is SlotState.TRIAL:
            self.set_slot_state(slot, SlotState.GOOD)
            self.trials_left = 0
            self.rollback_floor = max(self.rollback_floor, rec.rollback_index)
        return list(rec.pending_keys) if rec.state is SlotState.GOOD else []

    def keys_trusted(self, slot: str) -> None:
        self.slots[slot].pending_keys = []

    def fall_back(self, slot: str, why: str) -> str | None:
        """``slot`` is bad (its pending keys are dropped); the previous good slot becomes active.
        Returns it, or None when there is none (``active`` is then None)."""
        if self.slots[slot].state is not SlotState.BAD:
            self.set_slot_state(slot, SlotState.BAD)
        rec = self.slots[slot]
        rec.problem = why
        rec.pending_keys = []
        prev = self.good_fallback()
        self.trials_left = 0
        if prev is None:
            self.active = None
            return None
        self.active, self.previous = prev, None
        return prev

    def roll_back(self) -> str:
        """Make the previous good slot active (the caller checked it verifies and meets the floor)."""
        prev = self.good_fallback()
        assert prev is not None
        cur = self.active
        self.active = prev
        self.previous = cur if cur is not None and self.slots[cur].state is SlotState.GOOD else None
        self.trials_left = 0
        return prev

    def halted(self, why: str) -> None:
        """No slot may boot: nothing is started, ``halt`` says why."""
        self.halt = why
        self.booted = None
        self.health = Health.HALTED


def _slot_or_none(v: Any) -> str | None:
    if v is None or v in SLOTS:
        return v
    raise ValueError(f"{v!r} is not a slot")


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{v!r} is not an integer")
    return v
