"""Benchmarks of the node: HTTP serving (``serve``) and the TVM training step vs PyTorch (``train``).

Each returns one JSON-serialisable dict; ``fractal bench serve|train --json`` prints it.
"""

__all__ = ["loadgen", "serve", "train"]
