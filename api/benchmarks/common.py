"""Shared benchmark helpers: machine description and compiled zoo artifacts."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["machine", "zoo_artifact"]


def machine() -> dict[str, Any]:
    """CPU model, core count, load average and library versions: the context of every figure."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "arch": platform.machine(),
                            "python": platform.python_version()}
    try:
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    try:
        import tvm

        info["tvm"] = tvm.__version__
    except ImportError:
        pass
    return info


def zoo_artifact(name: str, work_dir: Path, *, batch: int = 32, lr: float = 0.01,
                 loss: str = "ce") -> Path:
    """``name`` from the zoo compiled for this machine with a training module (reused if present)."""
    from compiler import TrainSettings, compile_model, host_preset_name, load_artifact, zoo

    out = work_dir / f"{name}-b{batch}"
    if (out / "manifest.json").exists():
        try:
            load_artifact(out)
            return out
        except Exception:  # noqa: BLE001 - stale or foreign: rebuild
            pass
    work_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = work_dir / f"{name}-b{batch}.onnx"
    zoo.save(name, onnx_path, batch=batch)
    return compile_model(onnx_path, target=host_preset_name(), out_dir=out, name=name,
                         train=TrainSettings(loss=loss, optimizer="sgd", lr=lr, batch=batch), progress=False)
