"""A node's own stored samples as int8 calibration data (``fractal compile MODEL.onnx --quantize
int8 --calibration-from NODE_DATA_DIR``): a fleet ships one float model and each board quantizes
it for the data it sees. BENCHMARKS.md "int8 calibration: the node's own samples" measures
whether that is worth it.

The newest ``limit`` samples are taken (sensor data drifts; the newest say most about what the
model will see next), labelled or not: calibration only needs the inputs' ranges.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from compiler.quantize import CalibrationSet
from edgenode.errors import InvalidInput, StoreError
from edgenode.store import SampleSpec, SampleStore

__all__ = ["DEFAULT_SAMPLES", "STORE_FILE", "open_store", "store_calibration"]

DEFAULT_SAMPLES = 1000  # MinMax calibration settles long before this; the bound keeps memory small
STORE_FILE = "samples.db"  # in the node's data_dir (edgenode.node)


def open_store(data_dir: str | Path) -> SampleStore:
    """The sample store in a node's ``data_dir``, opened with the layout it was written with;
    StoreError with the fix when there is none."""
    data_dir = Path(data_dir)
    db = data_dir / STORE_FILE
    if not data_dir.is_dir():
        raise StoreError(f"node data dir {str(data_dir)!r} not found",
                         hint="pass the data_dir of the node's NODE.toml")
    if not db.is_file():
        raise StoreError(f"{str(data_dir)!r} holds no sample store ({STORE_FILE})",
                         hint="pass the data_dir of a node that has taken samples (its NODE.toml's data_dir)")
    try:  # read-only: never create or change anything just to learn the layout
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            row = con.execute("SELECT value FROM meta WHERE key='spec'").fetchone()
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise StoreError(f"{db} is not a readable sample store ({exc})",
                         hint="pass the data_dir of a fractal node") from None
    if row is None:
        raise StoreError(f"{db} has no sample layout", hint="pass the data_dir of a fractal node")
    try:
        return SampleStore(db, SampleSpec.from_json(row[0]))
    except sqlite3.Error as exc:  # e.g. a read-only copy: opening checks the schema in a write
        raise StoreError(f"cannot open the sample store {db} ({exc})",
                         hint="run as the node's user (opening writes the schema check)") from None


def store_calibration(store: SampleStore, limit: int = DEFAULT_SAMPLES) -> CalibrationSet:
    """The newest ``limit`` stored samples' inputs, by input name, as calibration data."""
    if limit < 1:
        raise InvalidInput(f"calibration sample count {limit} < 1", hint="take at least one batch of samples")
    snap = store.snapshot(limit)
    if len(snap) == 0:
        raise StoreError(f"the sample store {store.path} holds no samples",
                         hint="POST samples to the node's /v1/samples first, or calibrate with "
                              "--calibration DATA.npz")
    return CalibrationSet(dict(snap.inputs), f"the sample store {store.path}",
                          hint="the store holds samples of another model layout: calibrate the model "
                               "that node runs, on its own data_dir")
