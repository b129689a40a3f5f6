"""Helpers the preparation stage's rewrites share: fresh-named ONNX nodes and constants, and a
node's attribute by name. Imports nothing of the compiler, so every rewrite module (prepare,
unroll, lower_ops, lower_training) and the importer can use it without an import cycle."""

from __future__ import annotations

from typing import Any

import numpy as np


class Builder:
    """Emits nodes and initializers with fresh names under ``prefix``."""

    def __init__(self, model: Any, prefix: str) -> None:
        self.model, self.prefix, self.n = model, prefix, 0
        self.nodes: list[Any] = []
        self.inits: list[Any] = []

    def name(self, hint: str) -> str:
        self.n += 1
        return f"{self.prefix}/{hint}_{self.n}"

    def const(self, arr: np.ndarray, hint: str = "c") -> str:
        from onnx import numpy_helper

        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.array(arr, order="C"), name))
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
        import onnx

        out = out or self.name(op_type.lower())
        self.nodes.append(onnx.helper.make_node(op_type, inputs, [out], name=self.name(op_type), **attrs))
        return out


def node_attr(node: Any, name: str, default: Any = None) -> Any:
    """The value of ``node``'s attribute ``name`` (bytes decoded to str), or ``default``."""
    import onnx

    for a in node.attribute:
        if a.name == name:
            value = onnx.helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default
