"""Every benchmark of the project, in one place; ``fractal bench VERB`` (api/cli/bench_*.py) calls them.

Layer: above the apps (benchmarks start node and fleet apps) and ``deploy``; below the CLI.

* :mod:`bench.host`: the one description of the machine every figure is measured on.
* :mod:`bench.compile`: onnxruntime vs TVM untuned vs TVM tuned on the zoo models.
* :mod:`bench.allreduce`: ring vs star allreduce over MQTT, raw broker throughput.
* :mod:`bench.serve` (+ :mod:`~bench.node_proc`, :mod:`~bench.loadgen`): HTTP serving.
* :mod:`bench.train` (+ :mod:`~bench.onnx_torch`): a TVM training step vs PyTorch.
* :mod:`bench.artifacts`: compiled zoo artifacts shared by the serve and train benchmarks.

Each returns one JSON-serialisable dict. Heavy or dev-only dependencies (torch, onnxruntime,
TVM) are imported inside the functions that need them, never at module top.
"""

__all__ = ["allreduce", "artifacts", "compile", "host", "loadgen", "serve", "train"]
