"""The C runtime's thread pool (compiler/cruntime/fractal_rt.c): TVM's parallel loops run on
worker threads, the count set by the runner's --threads, fr_set_num_threads (CLibrary) or
FRACTAL_NUM_THREADS, and the outputs are bit-identical at every thread count.

One small convolution model (its kernels have parallel loops) compiled once for ``x86_64-c``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from compiler import compile_model
from compiler.clib import LIB_NAME, RUNNER_NAME, CLibrary


def _conv_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 4, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c1"], ["r1"]),
         helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c2"], ["y"])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 16, 16])],
        [helper.make_tensor("w1", TensorProto.FLOAT, w1.shape, w1.ravel()),
         helper.make_tensor("w2", TensorProto.FLOAT, w2.shape, w2.ravel())])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(m, str(path))
    return path


@pytest.fixture(scope="module")
def conv_c(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray], np.ndarray]:
    d = tmp_path_factory.mktemp("cthreads")
    out = compile_model(_conv_model(d / "conv.onnx"), target="x86_64-c", out_dir=d / "art", progress=False)
    params = np.load(out / "params.npz")
    x = np.random.default_rng(1).standard_normal((1, 4, 16, 16)).astype(np.float32)
    return out, [params[k] for k in params.keys()], x


_PROBE = """
import os, sys, numpy as np
from compiler.clib import CLibrary
lib = CLibrary(sys.argv[1])
data = np.load(sys.argv[2])
args = [data[k] for k in sorted(data.keys(), key=int)]
before = len(os.listdir("/proc/self/task"))
outs = {}
for n in map(int, sys.argv[4:]):
    got = lib.set_threads(n)
    assert got == lib.threads and (n == 0 or got == n)
    outs[str(n)] = lib.call("main", args)[0]
np.savez(sys.argv[3], **outs)
print(before, len(os.listdir("/proc/self/task")), lib.threads)
"""


def _probe(lib: Path, args: list[np.ndarray], tmp: Path, counts: list[int],
           env: dict[str, str] | None = None) -> tuple[list[int], dict[str, np.ndarray]]:
    np.savez(tmp / "args.npz", **{str(i): a for i, a in enumerate(args)})
    p = subprocess.run([sys.executable, "-c", _PROBE, str(lib), str(tmp / "args.npz"), str(tmp / "outs.npz"),
                        *map(str, counts)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr[-2000:]
    outs = np.load(tmp / "outs.npz")
    return [int(v) for v in p.stdout.split()], {k: outs[k] for k in outs.keys()}


def test_parallel_loops_run_on_threads_bit_identical(conv_c: tuple, tmp_path: Path) -> None:
    out, params, x = conv_c
    # 1 thread starts no worker; 3 threads start two, and every count gives the same bytes
    (before, after, _), outs = _probe(out / LIB_NAME, [x, *params], tmp_path, [1])
    assert after == before
    (before, after, now), outs3 = _probe(out / LIB_NAME, [x, *params], tmp_path, [1, 3, 2])
    assert after == before + 2 and now == 2
    ref = outs["1"]
    assert np.abs(ref).max() > 0
    for k in ("1", "3", "2"):
        assert outs3[k].tobytes() == ref.tobytes(), k
    # the default count comes from FRACTAL_NUM_THREADS (0: default)
    (_, _, now), _ = _probe(out / LIB_NAME, [x, *params], tmp_path, [0], env={"FRACTAL_NUM_THREADS": "3"})
    assert now == 3


def test_runner_threads_flag(conv_c: tuple, tmp_path: Path) -> None:
    out, params, x = conv_c
    ind = tmp_path / "in"
    ind.mkdir()
    for i, a in enumerate([x, *params]):
        np.save(ind / f"{i}.npy", a)
    res = []
    for n in ("1", "2"):
        od = tmp_path / f"out{n}"
        od.mkdir()
        subprocess.run([str(out / RUNNER_NAME), "--threads", n, "main", str(ind), str(od)], check=True,
                       timeout=60)
        res.append(np.load(od / "0.npy"))
    assert res[0].tobytes() == res[1].tobytes()
    assert np.array_equal(res[0], CLibrary(out / LIB_NAME).call("main", [x, *params])[0])
    for bad in ("0", "x", "65", ""):
        p = subprocess.run([str(out / RUNNER_NAME), "--threads", bad, "main", str(ind), str(tmp_path)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and p.stderr.startswith("error: --threads"), (bad, p.stderr)


@pytest.mark.slow
def test_riscv64_runner_threads_under_qemu(conv_c: tuple, tmp_path: Path) -> None:
    """Board images run the same runtime: the riscv64 runner on 1, 2 and 4 threads under
    qemu-user gives the same bytes, and the x86_64 build's outputs to float rounding."""
    from compiler.emulate import runner_command

    host_out, params, x = conv_c
    out = compile_model(host_out.parent / "conv.onnx", target="riscv64", out_dir=tmp_path / "rv",
                        progress=False)
    ind = tmp_path / "in"
    ind.mkdir()
    for i, a in enumerate([x, *params]):
        np.save(ind / f"{i}.npy", a)
    res = []
    for n in ("1", "2", "4"):
        od = tmp_path / f"out{n}"
        od.mkdir()
        cmd = [*runner_command(out / RUNNER_NAME, "riscv64"), "--threads", n, "main", str(ind), str(od)]
        subprocess.run(cmd, check=True, timeout=120, capture_output=True)
        res.append(np.load(od / "0.npy"))
    assert all(r.tobytes() == res[0].tobytes() for r in res)
    host = CLibrary(host_out / LIB_NAME).call("main", [x, *params])[0]
    assert np.abs(res[0] - host).max() <= 1e-4 * max(1.0, float(np.abs(host).max()))
