"""``fractal-run`` reads its .npy inputs with a parser of the header dict (issue 26, finding 15).

Before, the header was searched for substrings: a structured ``(f4, f4)`` dtype, an ``'<f8'``
header with a decoy ``'<f4'`` key and a Fortran-order file with decoy text were accepted and their
bytes read as a layout they did not have. Now every header numpy writes (versions 1.0, 2.0, 3.0)
is read, and anything else is refused with one ``error:`` line and exit status 1: generated
malformed headers and random corruptions never crash the runner (also built with AddressSanitizer
here), and whatever it accepts numpy reads as the same array.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from compiler import zoo
from compiler.cbackend import build_kernels, build_native, generate_entry, lower
from compiler.clib import LIB_NAME, CLibrary
from compiler.targets import get_preset, host_preset_name

GOOD_DICT = "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 16), }"
X = np.arange(16, dtype=np.float32).reshape(1, 16) / 7


def npy_bytes(header: str | bytes, data: bytes = X.tobytes(), version: tuple[int, int] = (1, 0),
              hlen: int | None = None, pad: bool = True) -> bytes:
    """An .npy file: magic, version, header length, ``header`` (padded to 64 with a newline)."""
    h = header.encode("latin-1") if isinstance(header, str) else header
    pre = 10 if version[0] == 1 else 12
    if pad:
        h += b" " * ((-(pre + len(h) + 1)) % 64) + b"\n"
    n = len(h) if hlen is None else hlen
    size = struct.pack("<H", n & 0xFFFF) if version[0] == 1 else struct.pack("<I", n & 0xFFFFFFFF)
    return b"\x93NUMPY" + bytes(version) + size + h + data


@pytest.fixture(scope="module")
def runners(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """sensor-mlp's ``main`` (x <f4(1, 16), then its parameters): the runner as shipped, and the
    same sources built with AddressSanitizer (so an out-of-bounds read fails loudly)."""
    from compiler.importer import import_model

    out = tmp_path_factory.mktemp("npy")
    imp = import_model(zoo.build("sensor-mlp"))
    preset = get_preset(host_preset_name())
    low = lower(imp.mod, preset.tvm_target())
    entry, _, _ = generate_entry(low, ["main"], "sensor-mlp")
    kobj = build_kernels(low, preset.tvm_target(), out / "kernels.o")
    built = {}
    for kind, flags in (("plain", ()), ("asan", ("-fsanitize=address", "-fno-omit-frame-pointer", "-g"))):
        b = build_native(entry, kobj, preset.arch, flags, out / kind)
        built[kind] = b.runner
    ind = out / "in"
    ind.mkdir()
    for i, p in enumerate(imp.params, start=1):
        np.save(ind / f"{i}.npy", p)
    built["in"] = ind
    built["lib"] = out / "plain" / LIB_NAME
    return built


def run(runner: Path, ind: Path, content: bytes, tmp: Path) -> tuple[int, str]:
    import subprocess

    (ind / "0.npy").write_bytes(content)
    outd = tmp / "out"
    outd.mkdir(exist_ok=True)
    env = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=99"}
    p = subprocess.run([str(runner), "main", str(ind), str(outd)], capture_output=True, text=True,
                       timeout=60, env=env)
    return p.returncode, p.stderr


def assert_refused(code: int, err: str, pattern: str = "") -> None:
    assert code == 1, (code, err)  # 99: AddressSanitizer; negative: a signal
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: bad input: "), err
    assert pattern in lines[0], lines[0]


def test_the_issue_attacks_are_refused(runners: dict[str, Path], tmp_path: Path) -> None:
    ind = runners["in"]
    # a structured (f4, f4) array of the compiled shape: its descr is a list holding '<f4'
    structured = np.zeros((1, 16), dtype=[("a", "<f4"), ("b", "<f4")])
    np.save(tmp_path / "s.npy", structured)
    assert_refused(*run(runners["plain"], ind, (tmp_path / "s.npy").read_bytes(), tmp_path),
                   "structured dtypes are not supported")
    # '<f8' data whose header carries a decoy '<f4' key
    decoy = "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 16), 'note': '<f4', }"
    assert_refused(*run(runners["plain"], ind, npy_bytes(decoy, X.astype("<f8").tobytes()), tmp_path),
                   "unknown key 'note'")
    assert_refused(*run(runners["plain"], ind, npy_bytes(decoy.replace(" 'note': '<f4',", ""),
                                                         X.astype("<f8").tobytes()), tmp_path),
                   "dtype is not <f4 (the file has '<f8')")
    # Fortran order with decoy text, for the (16, 32) weight where the order changes the values
    w = np.load(ind / "1.npy")
    fortran = ("{'descr': '<f4', 'fortran_order': True, 'shape': (16, 32), "
               "\"'fortran_order': False\": 0, }")
    (tmp_path / "in2").mkdir()
    for f in ind.iterdir():
        (tmp_path / "in2" / f.name).write_bytes(f.read_bytes())
    np.save(tmp_path / "in2" / "0.npy", X)
    (tmp_path / "in2" / "1.npy").write_bytes(npy_bytes(fortran, np.asfortranarray(w).tobytes(order="F")))
    code, err = run(runners["plain"], tmp_path / "in2", npy_bytes(GOOD_DICT), tmp_path)
    assert code == 1 and "1.npy: bad .npy header: unknown key" in err, err
    (tmp_path / "in2" / "1.npy").write_bytes(npy_bytes(fortran.replace(" \"'fortran_order': False\": 0,", ""),
                                                       np.asfortranarray(w).tobytes(order="F")))
    code, err = run(runners["plain"], tmp_path / "in2", npy_bytes(GOOD_DICT), tmp_path)
    assert code == 1 and "1.npy: not C order (fortran_order is True)" in err, err


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize("header", [
    GOOD_DICT,
    '{"shape": (1, 16), "fortran_order": False, "descr": "<f4"}',  # any key order, double quotes
    "{ 'descr' : '<f4' ,'fortran_order':False,'shape':( 1 ,16 , ) }",
], ids=["numpy", "reordered", "spacing"])
def test_every_header_numpy_can_write_is_read(header: str, version: tuple[int, int],
                                              runners: dict[str, Path], tmp_path: Path) -> None:
    content = npy_bytes(header, version=version)
    (tmp_path / "ref.npy").write_bytes(content)
    np.testing.assert_array_equal(np.load(tmp_path / "ref.npy"), X)  # numpy agrees it is valid
    code, err = run(runners["plain"], runners["in"], content, tmp_path)
    assert code == 0, err
    got = np.load(tmp_path / "out" / "0.npy")
    files = sorted(runners["in"].glob("*.npy"), key=lambda p: int(p.stem))
    params = [np.load(p) for p in files if p.stem != "0"]
    np.testing.assert_array_equal(got, CLibrary(runners["lib"]).call("main", [X, *params])[0])


def malformed() -> Iterator[tuple[str, bytes]]:
    """Generated .npy files the runner must refuse, each with a name saying why."""
    good = npy_bytes(GOOD_DICT)
    body = GOOD_DICT
    for cut in range(len(body)):  # the dict cut short anywhere
        yield f"cut-{cut}", npy_bytes(body[:cut])
    swaps = {
        "'<f4'": ["'<f8'", "'>f4'", "'f4'", "''", "'<f4 '", "'<F4'", "[('a', '<f4')]", "<f4", "'<f4\\x00'",
                  "'<f4", "'<f4\"", "('<f4',)", "'<f4' '<f4'", "'" + "f" * 40 + "'", "'|f4'", "'<f2'"],
        "False": ["True", "false", "0", "None", "Falsey", "'False'", "False False", "", "(False)"],
        "(1, 16)": ["(1, 16, 1)", "(16,)", "(16)", "16", "[1, 16]", "(1 16)", "(-1, 16)", "(1, +16)",
                    "(1, 0x10)", "(1,, 16)", "(,)", "(1, 16L)", "(1, 16.0)", "((1, 16),)", "(1, 16",
                    "(1, 99999999999999999999)", "(1, 9223372036854775807)", "(4294967296, 4294967296)",
                    "(1, 1, 1, 1, 1, 1, 1, 1, 1, 16)", "(0, 16)", "(1, 16) (1, 16)", "(1, 1_6)"],
        "'descr'": ["'desc'", "'descr '", "'DESCR'", "descr", "'shape'", "'fortran_order'", "'descr\\x'"],
        "'shape'": ["'shapes'", "'descr'", "shape", "''"],
        "'fortran_order'": ["'fortran'", "'shape'", "'c_order'"],
        ", }": [", , }", " }garbage", ", 'extra': 1, }", ", 'descr': '<f4', }", ", 'shape': (1, 16), }",
                ", } }", ", }}"],
        "{": ["[", "{{", "dict(", ""],
    }
    for old, news in swaps.items():
        assert old in body
        for k, new in enumerate(news):
            yield f"swap-{old}-{k}", npy_bytes(body.replace(old, new, 1))
    for key in ("'descr': '<f4', ", "'fortran_order': False, ", "'shape': (1, 16), "):
        yield f"missing-{key[:6]}", npy_bytes(body.replace(key, ""))
    yield "nul-byte", npy_bytes(body.replace("'<f4'", "'<f4\0'"))
    yield "non-ascii", npy_bytes(body.encode() + "é".encode())
    yield "no-newline", npy_bytes(body + " " * 5, pad=False)
    yield "newline-inside", npy_bytes(body.replace(", 'shape'", ",\n'shape'"))
    yield "text-after-newline", npy_bytes(body.encode() + b"\nx", pad=False)
    yield "tab-padding", npy_bytes(body.encode() + b"\t" * 3 + b"\n", pad=False)
    hlen = len(good) - 10 - X.nbytes
    for v in ((0, 0), (1, 1), (2, 1), (4, 0), (255, 255)):
        yield f"version-{v}", good[:6] + bytes(v) + good[8:]
    yield "magic", b"\x93NUMPZ" + good[6:]
    yield "empty", b""
    yield "magic-only", good[:6]
    yield "no-length", good[:9]
    for n in (0, 1, hlen - 1, hlen + 1, hlen + 64, 65535):
        yield f"hlen-{n}", good[:8] + struct.pack("<H", n) + good[10:]
    yield "hlen-v2-huge", npy_bytes(body, version=(2, 0), hlen=0xFFFFFFFF)
    yield "hlen-v2-over-limit", npy_bytes(body + " " * 70000, version=(2, 0))
    yield "data-short", good[:-1]
    yield "data-none", good[:-X.nbytes]
    yield "data-long", good + b"\0"
    yield "data-much-longer", good + bytes(4096)
    yield "header-only-v3", npy_bytes(body, b"", version=(3, 0))


def test_malformed_headers_are_refused_cleanly(runners: dict[str, Path], tmp_path: Path) -> None:
    """Every generated malformed file: exit 1 with one error line, under ASan too."""
    cases = list(malformed())
    assert len(cases) > 150
    failures = []
    for name, content in cases:
        for kind in ("plain", "asan"):
            code, err = run(runners[kind], runners["in"], content, tmp_path)
            lines = err.splitlines()
            if code != 1 or len(lines) != 1 or not lines[0].startswith("error: bad input: "):
                failures.append(f"{kind} {name}: exit {code}: {err[:300]!r}")
    assert not failures, "\n".join(failures)


def test_random_corruptions_never_crash_and_agree_with_numpy(runners: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """Seeded random byte changes in the prefix and header: the runner exits 0 or 1 (never a
    signal or an ASan report), and whatever it accepts numpy reads as the same C-order <f4 data."""
    rng = np.random.default_rng(26)
    good = npy_bytes(GOOD_DICT)
    head = len(good) - X.nbytes
    accepted = 0
    for i in range(300):
        buf = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            buf[int(rng.integers(0, head))] = int(rng.integers(0, 256))
        kind = "asan" if i % 3 == 0 else "plain"
        code, err = run(runners[kind], runners["in"], bytes(buf), tmp_path)
        assert code in (0, 1), (kind, bytes(buf[:head]), code, err)
        if code == 0:
            accepted += 1
            (tmp_path / "check.npy").write_bytes(bytes(buf))
            arr = np.load(tmp_path / "check.npy")
            assert arr.dtype == np.dtype("<f4") and arr.shape == (1, 16) and arr.flags.c_contiguous
            np.testing.assert_array_equal(arr, X)
        else:
            assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert accepted < 300  # the corruptions did reach the parser

