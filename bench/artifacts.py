"""Compiled zoo artifacts shared by the serve and train benchmarks (the host is :mod:`bench.host`)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["zoo_artifact"]


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
