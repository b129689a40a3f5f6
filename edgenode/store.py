"""Durable, bounded sample store on SQLite (WAL).

Durability: ``journal_mode=WAL`` + ``synchronous=FULL``. With WAL, NORMAL already survives a
process crash (kill -9): a committed transaction is in the WAL file, which the OS keeps. It
does NOT survive a power cut, because NORMAL skips the fsync of the WAL at commit. Boards lose
power far more often than servers, and the API promises "stored before 2xx", so we pay one
fsync per insert *batch* (one transaction per request, not per sample).

Retention (bound = ``max_samples``):
- ``drop-oldest`` (default): each insert deletes the oldest rows beyond the bound in the same
  transaction; the newest data wins because sensor data drifts.
- ``reject``: an insert that would exceed the bound raises :class:`StoreError` and stores nothing.

Each row holds one sample: the raw bytes of every model input (in spec order, fixed shapes and
dtypes recorded in a ``meta`` table so a store is never read with the wrong layout) and its label.

Validation share: each row also keeps ``split`` = :func:`split_key` of its bytes, a number in
[0, 1) fixed by the sample's content. With ``[training] validation_share = s`` the rows with
``split < s`` are validation, the others training: the same sample is always on the same side
(across restarts, on every node), and changing ``s`` needs no rewrite.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgenode.errors import InvalidInput, StoreError

__all__ = ["SampleSpec", "SampleStore", "Samples", "Part", "split_key"]

_SCHEMA_VERSION = 1


def split_key(data: bytes) -> float:
    """Where a sample falls in [0, 1) (a hash of its stored bytes): validation when below the share."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") / 2.0**64


@dataclass(frozen=True)
class SampleSpec:
    """Layout of one sample: per-input shapes (without batch dim) and dtypes, and the label's."""

    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    label_shape: tuple[int, ...]  # () for a class id
    label_dtype: str  # "int64" (class ids) or "float32" (regression targets)

    def to_json(self) -> str:
        return json.dumps({"inputs": [[n, list(s), d] for n, s, d in self.inputs],
                           "label_shape": list(self.label_shape), "label_dtype": self.label_dtype})

    @classmethod
    def from_json(cls, text: str) -> SampleSpec:
        d = json.loads(text)
        return cls(tuple((n, tuple(s), dt) for n, s, dt in d["inputs"]), tuple(d["label_shape"]),
                   d["label_dtype"])


@dataclass(frozen=True)
class Samples:
    """A consistent in-memory copy of stored samples: inputs by name (N, ...) and labels (N, ...)."""

    inputs: dict[str, np.ndarray]
    labels: np.ndarray
    known: np.ndarray | None = None  # bool (N,): whether each label was given (None: all were)

    def __len__(self) -> int:
        return int(self.labels.shape[0])


Part = str  # "train" or "val" (None in a call: every sample)
# Which rows a read returns: "any", "known" (labelled rows only: what a supervised round trains
# on), "normal" (rows not labelled as anomalous, i.e. unlabelled or label 0: what an anomaly
# model learns normal from).
Which = str


class SampleStore:
    """Thread-safe SQLite store; :meth:`add` is durable when it returns."""

    def __init__(self, path: str | Path, spec: SampleSpec, *, max_samples: int = 100_000,
                 retention: str = "drop-oldest", num_classes: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.max_samples = int(max_samples)
        self.num_classes = num_classes  # class-id labels are checked against it
        self.retention = str(retention)  # (a StrEnum member's str() is its value)
        if self.retention not in ("drop-oldest", "reject"):
            raise StoreError(f"unknown retention policy {self.retention!r}", hint="use drop-oldest or reject")
        self._lock = threading.Lock()
        self._closed = False
        self._write_error: str | None = None  # the last write failure, until a write succeeds
        # check_same_thread=False: one connection shared by the API threads and the round worker,
        # every use serialized by self._lock (SQLite writes are serialized anyway).
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS samples (id INTEGER PRIMARY KEY AUTOINCREMENT,"
                         " data BLOB NOT NULL, label BLOB NOT NULL)")
        self._check_spec()
        self._add_split_column()
        self._add_label_columns()
        self._count = self._db.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
        row = self._db.execute("SELECT value FROM meta WHERE key='trained_upto'").fetchone()
        self._trained_upto = int(row[0]) if row else 0  # see mark_trained

    def _add_split_column(self) -> None:
        """Stores written before the validation share get the column, computed from their rows."""
        cols = {r[1] for r in self._db.execute("PRAGMA table_info(samples)")}
        if "split" in cols:
            return
        with self._tx():
            self._db.execute("ALTER TABLE samples ADD COLUMN split REAL")
            rows = self._db.execute("SELECT id, data, label FROM samples").fetchall()
            self._db.executemany("UPDATE samples SET split = ? WHERE id = ?",
                                 [(split_key(d + lab), i) for i, d, lab in rows])

    def _add_label_columns(self) -> None:
        """``ts`` (when the sample was taken, unix s) and ``labelled`` (0: its label is not known
        yet, the label bytes are zeros): samples from streams come without labels, which may
        arrive later (:meth:`set_labels`). Older stores get both columns (their rows labelled)."""
        cols = {r[1] for r in self._db.execute("PRAGMA table_info(samples)")}
        with self._tx():
            if "ts" not in cols:
                self._db.execute("ALTER TABLE samples ADD COLUMN ts REAL")
            if "labelled" not in cols:
                self._db.execute("ALTER TABLE samples ADD COLUMN labelled INTEGER NOT NULL DEFAULT 1")
            self._db.execute("CREATE INDEX IF NOT EXISTS samples_ts ON samples (ts)")

    def _check_spec(self) -> None:
        row = self._db.execute("SELECT value FROM meta WHERE key='spec'").fetchone()
        if row is None:
            with self._tx():
                self._db.execute("INSERT INTO meta VALUES ('spec', ?), ('schema', ?)",
                                 (self.spec.to_json(), str(_SCHEMA_VERSION)))
        elif SampleSpec.from_json(row[0]) != self.spec:
            raise StoreError(f"sample store {self.path} holds samples of another model layout",
                             hint="use a fresh data_dir for a different model, or delete samples.db")

    def _tx(self) -> _Tx:
        return _Tx(self._db)

    @property
    def count(self) -> int:
        """Number of stored samples."""
        return self._count

    def __len__(self) -> int:
        return self._count

    def validate(self, inputs: dict[str, np.ndarray],
                 labels: np.ndarray | None) -> tuple[list[np.ndarray], np.ndarray]:
        """Check names, per-sample shapes, dtypes and label count; return arrays in spec order.
        ``labels=None``: unlabelled samples (zero labels are returned for them)."""
        names = [n for n, _, _ in self.spec.inputs]
        extra = [n for n in inputs if n not in names]
        if extra:
            raise InvalidInput(f"unknown input {extra[0]!r}", hint=f"the model's inputs are {names}")
        missing = [n for n in names if n not in inputs]
        if missing:
            raise InvalidInput(f"missing input {missing[0]!r}", hint=f"the model's inputs are {names}")
        arrays: list[np.ndarray] = []
        n = None
        for name, shape, dtype in self.spec.inputs:
            a = np.asarray(inputs[name])
            if a.ndim != len(shape) + 1 or tuple(a.shape[1:]) != shape:
                raise InvalidInput(f"input {name!r}: samples have shape {list(a.shape[1:])}, "
                                   f"expected {list(shape)}",
                                   hint=f"send a list of samples each shaped {list(shape)}")
            if not _castable(a.dtype, np.dtype(dtype)):
                raise InvalidInput(f"input {name!r}: dtype {a.dtype} cannot be stored as {dtype}",
                                   hint=f"send {dtype} numbers")
            if n is not None and a.shape[0] != n:
                raise InvalidInput(f"input {name!r} has {a.shape[0]} samples, other inputs have {n}")
            n = a.shape[0]
            with np.errstate(over="ignore", invalid="ignore"):  # out of range -> inf, refused below
                arrays.append(np.ascontiguousarray(a, dtype=dtype))
        if labels is None:
            labels = np.zeros((n or 0, *self.spec.label_shape), self.spec.label_dtype)
        lab = np.asarray(labels)
        if lab.shape != (n, *self.spec.label_shape):
            raise InvalidInput(f"labels: shape {list(lab.shape)}, expected {[n, *self.spec.label_shape]}",
                               hint="send one label per sample")
        if lab.dtype.kind == "f" and self.spec.label_dtype == "int64" and np.all(np.mod(lab, 1) == 0):
            lab = lab.astype(np.int64)  # JSON clients may send 3.0 for class 3
        if not _castable(lab.dtype, np.dtype(self.spec.label_dtype)):
            raise InvalidInput(f"labels: dtype {lab.dtype} cannot be stored as {self.spec.label_dtype}",
                               hint="class labels must be integers" if self.spec.label_dtype == "int64"
                               else "targets must be numbers")
        if n == 0:
            raise InvalidInput("no samples in the request", hint="send at least one sample")
        self.check_inputs(arrays)
        lab = np.ascontiguousarray(lab, dtype=self.spec.label_dtype)
        self.check_labels(lab)
        return arrays, lab

    @staticmethod
    def check_inputs(arrays: Sequence[np.ndarray]) -> None:
        """Samples train, so they are finite (inference takes NaN and infinity; training data never
        does: one NaN sample would make every member's parameters NaN). InvalidInput otherwise.
        Also run on what a round reads (a store written by hand or by an older node)."""
        for a in arrays:
            if a.dtype.kind == "f" and not np.isfinite(a).all():
                raise InvalidInput("inputs contain NaN or Inf", hint="samples train: send finite numbers")

    def check_labels(self, lab: np.ndarray) -> None:
        """Class ids in [0, num_classes), regression targets finite; InvalidInput otherwise.
        Also run on what a round reads: a store written by hand or for another model may hold
        labels the compiled loss must never see."""
        if self.num_classes is not None and lab.size and (lab.min() < 0 or lab.max() >= self.num_classes):
            raise InvalidInput(f"labels must be class ids in [0, {self.num_classes}), got {int(lab.min())}.."
                               f"{int(lab.max())}", hint=f"the model has {self.num_classes} classes")
        if lab.dtype.kind == "f" and not np.isfinite(lab).all():
            raise InvalidInput("labels contain NaN or Inf", hint="send finite numbers")

    def add(self, inputs: dict[str, np.ndarray], labels: np.ndarray | None, *,
            ts: np.ndarray | list[float] | None = None) -> int:
        """Insert a batch in ONE transaction, durable (fsynced) on return; returns the new count.
        ``labels=None``: the samples' labels are not known (yet); ``ts``: when each was taken
        (unix seconds; default now)."""
        return self.insert(inputs, labels, ts=ts)[1]

    def insert(self, inputs: dict[str, np.ndarray], labels: np.ndarray | None, *,
               ts: np.ndarray | list[float] | None = None) -> tuple[list[int], int]:
        """As :meth:`add`; returns the new rows' ids and the new count."""
        arrays, lab = self.validate(inputs, labels)
        n = lab.shape[0]
        now = time.time()
        when = np.full(n, now) if ts is None else np.asarray(ts, np.float64).reshape(-1)
        if when.shape != (n,) or not np.isfinite(when).all():
            raise InvalidInput("ts: one finite time per sample")
        known = int(labels is not None)
        rows = []
        for i in range(n):
            data, label = b"".join(a[i].tobytes() for a in arrays), lab[i].tobytes()
            rows.append((data, label, split_key(data + label), float(when[i]), known))
        with self._lock:
            if self.retention == "reject" and self._count + n > self.max_samples:
                raise StoreError(f"sample store is full ({self._count}/{self.max_samples} samples)",
                                 hint="raise [store].max_samples or use retention = \"drop-oldest\"")
            try:
                with self._tx():
                    ids = [int(self._db.execute("INSERT INTO samples (data, label, split, ts, labelled) "
                                                "VALUES (?, ?, ?, ?, ?)", r).lastrowid or 0) for r in rows]
                    over = self._count + n - self.max_samples
                    if over > 0:  # drop-oldest: ids grow monotonically (AUTOINCREMENT), oldest = smallest
                        self._db.execute("DELETE FROM samples WHERE id IN "
                                         "(SELECT id FROM samples ORDER BY id LIMIT ?)", (over,))
            except sqlite3.Error as exc:  # read-only or full disk, I/O error: nothing was stored
                self._write_error = str(exc)
                raise StoreError(f"the sample store cannot write ({exc}); nothing was stored",
                                 hint="check the node's data_dir (permissions, free space)") from None
            self._write_error = None
            self._count = min(self._count + n, self.max_samples)
            return ids, self._count

    def set_labels(self, label: np.ndarray | float | int, *, ids: list[int] | None = None,
                   since: float | None = None, until: float | None = None) -> int:
        """Give stored samples a label that arrived later: the rows ``ids``, or the rows taken in
        ``[since, until)`` (unix s). One durable transaction; returns how many rows it labelled.
        The validation side of a row stays where it was (it is fixed at insert)."""
        try:
            lab = np.asarray(label)
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"label is malformed: {exc}") from None
        if lab.dtype.kind == "f" and self.spec.label_dtype == "int64" and np.isfinite(lab).all() \
                and np.all(np.mod(lab, 1) == 0):
            lab = lab.astype(np.int64)
        if lab.shape != self.spec.label_shape or not _castable(lab.dtype, np.dtype(self.spec.label_dtype)):
            raise InvalidInput(f"label: shape {list(lab.shape)} dtype {lab.dtype}, expected shape "
                               f"{list(self.spec.label_shape)} of {self.spec.label_dtype}")
        lab = np.ascontiguousarray(lab, dtype=self.spec.label_dtype)
        self.check_labels(lab.reshape(1, *lab.shape))
        if (ids is None) == (since is None and until is None):
            raise InvalidInput("give either sample ids or a time range", hint="ids: [...] or since/until")
        if ids is not None:
            where = f"id IN ({','.join('?' * len(ids))})"
            args: tuple[object, ...] = tuple(int(i) for i in ids)
            if not ids:
                return 0
        else:
            lo = -np.inf if since is None else float(since)
            hi = np.inf if until is None else float(until)
            if np.isnan(lo) or np.isnan(hi) or lo >= hi:
                raise InvalidInput("since must be before until")
            where, args = "ts >= ? AND ts < ?", (lo, hi)
        with self._lock:
            try:
                with self._tx():
                    cur = self._db.execute(f"UPDATE samples SET label = ?, labelled = 1 WHERE {where}",
                                           (lab.tobytes(), *args))
            except sqlite3.Error as exc:
                raise StoreError(f"the sample store cannot write ({exc}); no label was stored",
                                 hint="check the node's data_dir (permissions, free space)") from None
            return int(cur.rowcount)

    def problem(self) -> str | None:
        """Why the store cannot take samples now (closed, or its last write failed), or None."""
        if self._closed:
            return "the sample store is closed"
        if self._write_error is not None:
            return f"the sample store cannot write: {self._write_error}"
        return None

    @property
    def sample_bytes(self) -> int:
        """Bytes of one sample (all inputs + label) in memory."""
        size = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for _, s, d in self.spec.inputs)
        label = int(np.prod(self.spec.label_shape, dtype=np.int64)) * np.dtype(self.spec.label_dtype).itemsize
        return size + label

    def snapshot(self, limit: int | None = None, *, part: Part | None = None, share: float = 0.0,
                 which: Which = "any") -> Samples:
        """The stored samples (or the newest ``limit``) as arrays; a consistent read. ``part``:
        only the training (``split >= share``) or the validation (``split < share``) samples;
        ``which``: all, only labelled, or only normal rows (see :data:`Which`)."""
        where, args = self._where(part, share, which)
        with self._lock:
            if limit is None:
                rows = self._db.execute(f"SELECT data, label, labelled FROM samples {where} ORDER BY id",
                                        args).fetchall()
            else:
                rows = self._db.execute(f"SELECT data, label, labelled FROM samples {where} "
                                        "ORDER BY id DESC LIMIT ?", (*args, int(limit))).fetchall()[::-1]
        return self._decode(rows)

    def _where(self, part: Part | None, share: float, which: Which) -> tuple[str, tuple[object, ...]]:
        where, part_args = _part_clause(part, share)
        args: tuple[object, ...] = part_args
        conds: list[str] = [where.removeprefix("WHERE ")] if where else []
        if which == "known":
            conds.append("labelled = 1")
        elif which == "normal":
            zero = bytes(np.zeros(self.spec.label_shape, self.spec.label_dtype).tobytes())
            conds.append("(labelled = 0 OR label = ?)")
            args = (*args, zero)
        elif which != "any":
            raise ValueError(f"which must be 'any', 'known' or 'normal', not {which!r}")
        return ("WHERE " + " AND ".join(conds)) if conds else "", args

    def count_labelled(self) -> int:
        """How many stored samples have a known label."""
        with self._lock:
            if self._closed:
                return 0
            return int(self._db.execute("SELECT COUNT(*) FROM samples WHERE labelled = 1").fetchone()[0])

    def count_part(self, part: Part, share: float) -> int:
        """How many stored samples are training (``part="train"``) or validation (``"val"``)."""
        where, args = _part_clause(part, share)
        with self._lock:
            if self._closed:
                return 0
            return int(self._db.execute(f"SELECT COUNT(*) FROM samples {where}", args).fetchone()[0])

    def _decode(self, rows: list[tuple[bytes, bytes, int]]) -> Samples:
        n = len(rows)
        data = np.frombuffer(b"".join(r[0] for r in rows), dtype=np.uint8).reshape(n, -1) if n else \
            np.zeros((0, 0), np.uint8)
        inputs: dict[str, np.ndarray] = {}
        off = 0
        for name, shape, dtype in self.spec.inputs:
            size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if n:
                chunk = np.ascontiguousarray(data[:, off:off + size])
                inputs[name] = chunk.view(dtype).reshape(n, *shape)
            else:
                inputs[name] = np.zeros((0, *shape), dtype=dtype)
            off += size
        labels = np.frombuffer(b"".join(r[1] for r in rows), dtype=self.spec.label_dtype)
        labels = labels.reshape(n, *self.spec.label_shape).copy()
        known = np.fromiter((bool(r[2]) for r in rows), dtype=bool, count=n)
        return Samples(inputs, labels, known)

    def last_id(self) -> int:
        """The id of the newest sample ever stored (ids only grow; 0 for a new store)."""
        with self._lock:
            if self._closed:
                return 0
            row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name='samples'").fetchone()
            return int(row[0]) if row else 0

    def mark_trained(self, upto_id: int) -> None:
        """A committed round trained on the samples up to ``upto_id`` (the :meth:`last_id` when it
        took them): :meth:`count_new` counts from there. Durable (a restarted node keeps it)."""
        with self._lock:
            if self._closed or upto_id <= self._trained_upto:
                return
            with self._tx():
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('trained_upto', ?)", (str(upto_id),))
            self._trained_upto = int(upto_id)

    def count_new(self) -> int:
        """How many stored samples arrived after the last committed round took its samples (all of
        them before the first): the figure the fleet's automatic rounds wait on."""
        with self._lock:
            if self._closed:
                return 0
            return int(self._db.execute("SELECT COUNT(*) FROM samples WHERE id > ?",
                                        (self._trained_upto,)).fetchone()[0])

    def clear(self) -> None:
        """Delete every sample (durably)."""
        with self._lock, self._tx():
            self._db.execute("DELETE FROM samples")
            self._count = 0

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._db.close()


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT / ROLLBACK (autocommit connection, explicit transactions)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")


def _part_clause(part: Part | None, share: float) -> tuple[str, tuple[float, ...]]:
    if part is None:
        return "", ()
    if part == "val":
        return "WHERE split < ?", (float(share),)
    if part == "train":
        return "WHERE split >= ?", (float(share),)
    raise ValueError(f"part must be 'train' or 'val', not {part!r}")


def _castable(src: np.dtype, dst: np.dtype) -> bool:
    """Accept lossless-enough casts: any number to float, integers (incl. bool) to integers."""
    if dst.kind == "f":
        return src.kind in "fiub"
    if dst.kind in "iu":
        return src.kind in "iub"
    return src == dst
