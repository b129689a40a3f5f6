"""SampleStore: durability across kill -9, the bound and its retention policies, validation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgenode.errors import InvalidInput, StoreError
from edgenode.store import SampleSpec, SampleStore

SPEC = SampleSpec((("x", (4,), "float32"),), (), "int64")

WRITER = r"""
import sys, numpy as np
from edgenode.store import SampleSpec, SampleStore
store = SampleStore(sys.argv[1], SampleSpec((("x", (4,), "float32"),), (), "int64"), max_samples=10**6)
i = 0
while True:
    x = np.full((5, 4), i, np.float32)
    n = store.add({"x": x}, np.arange(5) + 5 * i)
    print("ACK", i, n, flush=True)   # acknowledged: add() returned
    i += 1
"""


def test_acknowledged_samples_survive_kill_9(tmp_path):
    db = tmp_path / "samples.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2])
    acked = -1
    try:
        for line in proc.stdout:
            acked = int(line.split()[1])
            if acked >= 40:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # right after an acknowledged insert, mid-way through the next
        proc.wait(10)
    assert acked >= 40
    store = SampleStore(db, SPEC, max_samples=10**6)
    snap = store.snapshot()
    assert store.count == len(snap) >= 5 * (acked + 1)
    # every acknowledged batch is complete and intact (a torn batch would break these)
    assert len(snap) % 5 == 0
    for i in range(acked + 1):
        rows = snap.inputs["x"][5 * i:5 * i + 5]
        np.testing.assert_array_equal(rows, np.full((5, 4), i, np.float32))
        np.testing.assert_array_equal(snap.labels[5 * i:5 * i + 5], np.arange(5) + 5 * i)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_drop_oldest_keeps_newest(tmp_path):
    store = SampleStore(tmp_path / "s.db", SPEC, max_samples=10)
    for i in range(4):
        n = store.add({"x": np.full((4, 4), i, np.float32)}, np.full(4, i))
    assert n == 10 and store.count == 10
    snap = store.snapshot()
    # 16 inserted, the 6 oldest dropped: the first batch is gone, 2 of the second remain
    assert snap.labels.tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    store.close()
    assert SampleStore(tmp_path / "s.db", SPEC, max_samples=10).count == 10


def test_reject_when_full_stores_nothing(tmp_path):
    store = SampleStore(tmp_path / "s.db", SPEC, max_samples=6, retention="reject")
    assert store.add({"x": np.zeros((4, 4))}, np.zeros(4, np.int64)) == 4
    with pytest.raises(StoreError, match="full"):
        store.add({"x": np.zeros((3, 4))}, np.zeros(3, np.int64))
    assert store.count == 4 and len(store.snapshot()) == 4


@pytest.mark.parametrize(("inputs", "labels", "needle"), [
    ({}, [1], "missing input 'x'"),
    ({"x": np.zeros((1, 4)), "y": np.zeros((1, 4))}, [1], "unknown input 'y'"),
    ({"x": np.zeros((2, 5))}, [1, 2], "expected [4]"),
    ({"x": np.zeros((2, 4))}, [1], "labels: shape"),
    ({"x": np.array([["a"] * 4])}, [1], "dtype"),
    ({"x": np.zeros((1, 4))}, [1.5], "dtype"),
    ({"x": np.zeros((1, 4))}, [10], "class ids"),
    ({"x": np.full((1, 4), np.nan)}, [1], "NaN"),
])
def test_validation(tmp_path, inputs, labels, needle):
    store = SampleStore(tmp_path / "s.db", SPEC, num_classes=10)
    with pytest.raises(InvalidInput) as ei:
        store.add(inputs, np.asarray(labels))
    assert needle in str(ei.value)
    assert store.count == 0


def test_other_layout_refused(tmp_path):
    SampleStore(tmp_path / "s.db", SPEC).close()
    with pytest.raises(StoreError, match="another model layout"):
        SampleStore(tmp_path / "s.db", SampleSpec((("x", (8,), "float32"),), (), "int64"))


def test_snapshot_limit_and_float_labels(tmp_path):
    spec = SampleSpec((("a", (2, 2), "float32"), ("b", (3,), "int32")), (2,), "float32")
    store = SampleStore(tmp_path / "s.db", spec)
    a = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    b = np.arange(9, dtype=np.int32).reshape(3, 3)
    y = np.arange(6, dtype=np.float32).reshape(3, 2)
    store.add({"a": a, "b": b}, y)
    snap = store.snapshot()
    np.testing.assert_array_equal(snap.inputs["a"], a)
    np.testing.assert_array_equal(snap.inputs["b"], b)
    np.testing.assert_array_equal(snap.labels, y)
    last = store.snapshot(limit=2)
    np.testing.assert_array_equal(last.labels, y[1:])


def test_sample_bytes():
    store_spec = SampleSpec((("a", (2, 3), "float32"), ("b", (4,), "int32")), (), "int64")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        store = SampleStore(Path(d) / "s.db", store_spec)
        assert store.sample_bytes == 2 * 3 * 4 + 4 * 4 + 8
        store.close()


def test_unlabelled_rows_late_labels_and_an_older_store(tmp_path):
    """Rows without labels are read as unknown, get labels later by id or time, and a store
    written before these columns keeps its rows as labelled."""
    import sqlite3

    spec = SampleSpec((("x", (2,), "float32"),), (), "int64")
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)  # the schema of a store before ts/labelled existed
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute("INSERT INTO meta VALUES ('spec', ?), ('schema', '1')", (spec.to_json(),))
    db.execute("CREATE TABLE samples (id INTEGER PRIMARY KEY AUTOINCREMENT, data BLOB NOT NULL, "
               "label BLOB NOT NULL, split REAL)")
    db.execute("INSERT INTO samples (data, label, split) VALUES (?, ?, 0.5)",
               (np.zeros(2, np.float32).tobytes(), np.int64(4).tobytes()))
    db.commit()
    db.close()
    store = SampleStore(path, spec, num_classes=5)
    try:
        ids, count = store.insert({"x": np.ones((3, 2), np.float32)}, None, ts=[10.0, 20.0, 30.0])
        assert count == 4 and ids == [2, 3, 4]
        snap = store.snapshot()
        assert snap.known.tolist() == [True, False, False, False] and snap.labels.tolist() == [4, 0, 0, 0]
        assert len(store.snapshot(which="known")) == 1 and len(store.snapshot(which="normal")) == 3
        assert store.set_labels(1, since=15.0, until=30.0) == 1  # until is exclusive
        assert store.set_labels(2, ids=[4, 99]) == 1
        assert store.snapshot(which="known").labels.tolist() == [4, 1, 2]
        assert len(store.snapshot(which="normal")) == 1  # only the unlabelled row 2
        with pytest.raises(InvalidInput):
            store.set_labels(5, ids=[2])  # 5 classes: 0..4
        with pytest.raises(InvalidInput):
            store.set_labels(1)  # neither ids nor a time range
        with pytest.raises(InvalidInput):
            store.insert({"x": np.ones((1, 2), np.float32)}, None, ts=[float("nan")])
    finally:
        store.close()


def test_samples_new_since_the_last_trained_round_survives_a_restart(tmp_path):
    """count_new: the samples after the last committed round took its own (the status's
    samples_new, which the fleet's automatic rounds wait on); drop-oldest cannot make it grow."""
    store = SampleStore(tmp_path / "s.db", SPEC, max_samples=10)
    assert store.count_new() == 0 and store.last_id() == 0
    store.add({"x": np.zeros((6, 4), np.float32)}, np.zeros(6))
    assert store.count_new() == 6
    taken = store.last_id()  # a round takes its samples here ...
    store.add({"x": np.ones((3, 4), np.float32)}, np.ones(3))  # ... these arrive during it
    store.mark_trained(taken)  # ... and it commits
    assert store.count_new() == 3
    store.mark_trained(taken - 2)  # an older mark never moves it back
    assert store.count_new() == 3
    store.add({"x": np.ones((8, 4), np.float32)}, np.ones(8))  # past max_samples: the oldest go
    assert store.count == 10 and store.count_new() == 10
    store.close()
    again = SampleStore(tmp_path / "s.db", SPEC, max_samples=10)
    assert again.count_new() == 10 and again.last_id() == 17
    again.mark_trained(again.last_id())
    assert again.count_new() == 0
    again.close()
