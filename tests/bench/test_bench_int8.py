"""The int8 figures' benchmarks end to end at small sizes (marker bench: `make bench`): `bench.int8`
(integer kernels next to onnxruntime int8 / float32, same threads) and `bench.int8_calibration`
(calibration source, re-quantize cost, a node's swap after a real round)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def _json(module: str, *args: str) -> dict:
    p = subprocess.run([sys.executable, "-m", module, *args, "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(out["loadavg"]) == 3 and out["rows"]
    return out


def test_int8_bench_rows_per_thread_count():
    out = _json("bench.int8", "--models", "fc-autoencoder", "--threads", "1,2", "--seconds", "0.3")
    assert out["target"] == "x86_64-avx2"
    assert [(r["model"], r["threads"]) for r in out["rows"]] == [("fc-autoencoder", 1), ("fc-autoencoder", 2)]
    for r in out["rows"]:
        for k in ("ort_f32_us", "ort_int8_us", "tvm_qdq_us", "tvm_int8_us"):
            assert r[k] > 0, (k, r)
        # the ratios are the row's own timings divided, not figures from elsewhere
        assert r["tvm_vs_ort_int8"] == pytest.approx(r["tvm_int8_us"] / r["ort_int8_us"], abs=0.01)
        assert r["tvm_vs_ort_f32"] == pytest.approx(r["tvm_int8_us"] / r["ort_f32_us"], abs=0.01)


def test_int8_bench_unknown_model_fails():
    p = subprocess.run([sys.executable, "-m", "bench.int8", "--models", "no-such-model", "--threads", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "no-such-model" in p.stderr


def test_calibration_sources_on_digits():
    out = _json("bench.int8_calibration", "--samples", "200")
    rows = {(r.get("node"), r.get("calibration")): r for r in out["rows"]}
    assert rows, out
    own = [r for (node, cal), r in rows.items() if cal == "own"]
    assert own, rows.keys()
    for r in own:
        # calibrated on the node's own store, int8 stays within a few points of float on its data
        assert r["int8_top1"] >= r["float_top1"] - 5, r


def test_swap_cost_and_node_swap():
    cost = _json("bench.int8_calibration", "--swap-cost", "digits-mlp", "--samples", "64")["rows"][0]
    assert cost["model"] == "digits-mlp" and cost["cal_samples"] == 64
    parts = cost["read_store_s"] + cost["quantize_s"] + cost["compile_s"] + cost["load_and_first_infer_s"]
    assert cost["total_s"] == pytest.approx(parts, abs=0.05)
    swap = _json("bench.int8_calibration", "--node-swap", "digits-mlp", "--samples", "200",
                 "--steps", "10")["rows"][0]
    assert swap["model"] == "digits-mlp" and swap["round_steps"] == 10
    assert swap["commit_to_int8_s"] > 0 and swap["build_s"] > 0
    # the rebuilt library follows the committed float model more closely than the stale one
    assert swap["int8_agree_with_float"] >= swap["stale_agree_with_float"], swap
    assert swap["int8_agree_with_float"] >= 90, swap
    for phase in ("latency_rest_ms", "latency_rebuild_ms"):
        assert swap[phase], (phase, swap)


def test_keyword_spotting_accuracy_small():
    """The zoo's DS-CNN trained on the synthesised keywords (small: 60 per class, 10 epochs): the
    trained weights land in the zoo graph, int8 stays near float and within a step of onnxruntime."""
    rows = {r["run"]: r for r in _json("bench.int8_kws", "--per-class", "60", "--epochs", "10")["rows"]}
    f32 = rows["float32 (onnxruntime)"]
    assert f32["top1"] > 100 / 12 * 2, f32  # learnt something: twice chance at least
    ours = rows["int8 integer kernels (x86_64-avx2)"]
    assert ours["steps_from_ort_int8"] <= 1 and ours["agree_with_float"] >= 90, ours
    assert abs(ours["vs_float_points"]) <= 5, ours


def test_keyword_bench_bad_arguments_fail_in_one_line():
    p = subprocess.run([sys.executable, "-m", "bench.int8_kws", "--per-class", "3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1


def test_int8_profile_accounts_for_every_kernel_of_a_call():
    p = subprocess.run([sys.executable, "-m", "bench.int8_profile", "--model", "fc-autoencoder",
                        "--calls", "30", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["model"] == "fc-autoencoder" and out["target"] == "x86_64-avx2" and out["plain_us"] > 0
    groups = out["groups"]
    assert groups["int8 conv / matmul"]["calls"] == 10  # its ten Gemm layers, each an integer kernel
    assert all(g["us"] > 0 for name, g in groups.items() if name != "the rest of infer()"), groups
    rest = groups["the rest of infer()"]
    assert rest["calls"] > 0  # the VM's builtins were counted
    kernels = sum(g["us"] for name, g in groups.items() if name != "the rest of infer()")
    # the rest is the call minus its kernels (never below zero)
    assert rest["us"] == pytest.approx(max(0.0, out["plain_us"] - kernels), abs=0.2)
    assert out["top"]
    assert all(t["calls"] >= 1 and not t["symbol"].startswith("vm.builtin") for t in out["top"])


@pytest.mark.parametrize("args", [["--calls", "0"], ["--model", "no-such-model"]])
def test_int8_profile_bad_arguments_fail_in_one_line(args):
    p = subprocess.run([sys.executable, "-m", "bench.int8_profile", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
