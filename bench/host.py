"""The one description of the host a benchmark ran on (every figure's context)."""

from __future__ import annotations

import os
import platform
from typing import Any

from compiler.targets import cpu_model  # one reader of /proc/cpuinfo's model name

__all__ = ["cpu_model", "machine", "machine_line"]


def machine() -> dict[str, Any]:
    """CPU model, CPU count, OS, Python, load average and the measured libraries' versions."""
    cores = os.cpu_count()
    info: dict[str, Any] = {"cpu": cpu_model(), "cores": cores, "logical_cpus": cores,
                            "arch": platform.machine(), "os": f"{platform.system()} {platform.release()}",
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
    try:
        import onnxruntime

        info["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    return info


def machine_line() -> str:
    """One line describing this host (CPU model, cores, OS, Python), without importing any library."""
    return (f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def print_rows(target: str, rows: list, as_json: bool) -> None:
    """A bench module's result rows with the machine's load: one JSON object, or a row per line."""
    import json
    import os

    if as_json:
        print(json.dumps({"target": target, "loadavg": os.getloadavg(), "rows": rows}))
    else:
        for r in rows:
            print(r)
        print("load average", os.getloadavg())
