"""The zoo's ONNX graphs as PyTorch modules with the SAME weights (copied from the initializers).

A tiny graph interpreter over the ops the zoo uses (Conv with explicit pads and groups,
BatchNormalization in inference form, Relu, Add, GlobalAveragePool, Flatten, Gemm), so the
PyTorch baseline of ``fractal bench train`` computes exactly what the TVM training module does.
Initializers the TVM importer turned into trainable parameters become ``nn.Parameter``s; the
others (BatchNorm running statistics) stay fixed buffers, as in the compiled module.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from onnx import ModelProto, numpy_helper

__all__ = ["OnnxTorch"]


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class OnnxTorch(torch.nn.Module):
    """``OnnxTorch(model, trainable=names)(x) -> output``; raises ValueError on an unsupported op."""

    SUPPORTED = {"Conv", "BatchNormalization", "Relu", "Add", "GlobalAveragePool", "Flatten", "Gemm"}

    def __init__(self, model: ModelProto, trainable: Iterable[str]) -> None:
        super().__init__()
        trainable = set(trainable)
        self.nodes = list(model.graph.node)
        bad = {n.op_type for n in self.nodes} - self.SUPPORTED
        if bad:
            raise ValueError(f"unsupported ONNX op(s) for the PyTorch baseline: {sorted(bad)}")
        self.input_name = model.graph.input[0].name
        self.output_name = model.graph.output[0].name
        self.params = torch.nn.ParameterDict()
        self.fixed: dict[str, torch.Tensor] = {}
        self._keys: dict[str, str] = {}
        for init in model.graph.initializer:
            arr = torch.from_numpy(np.array(numpy_helper.to_array(init), dtype=np.float32))
            if init.name in trainable:
                key = f"p{len(self._keys)}"  # ParameterDict keys may not contain dots
                self._keys[init.name] = key
                self.params[key] = torch.nn.Parameter(arr)
            else:
                self.fixed[init.name] = arr

    def tensor(self, name: str) -> torch.Tensor:
        key = self._keys.get(name)
        return self.params[key] if key is not None else self.fixed[name]

    def param_list(self, names: list[str]) -> list[torch.nn.Parameter]:
        """Parameters in the given (artifact) order."""
        return [self.params[self._keys[n]] for n in names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        env: dict[str, torch.Tensor] = {self.input_name: x}

        def get(name: str) -> torch.Tensor:
            return env[name] if name in env else self.tensor(name)

        for node in self.nodes:
            a = _attrs(node)
            ins = [get(i) for i in node.input if i]
            op = node.op_type
            if op == "Conv":
                top, left, bottom, right = a.get("pads", [0, 0, 0, 0])
                y = F.pad(ins[0], (left, right, top, bottom))
                bias = ins[2] if len(ins) > 2 else None
                y = F.conv2d(y, ins[1], bias, stride=tuple(a.get("strides", [1, 1])),
                             groups=int(a.get("group", 1)))
            elif op == "BatchNormalization":
                x_, gamma, beta, mean, var = ins
                shape = (1, -1) + (1,) * (x_.dim() - 2)
                eps = float(a.get("epsilon", 1e-5))
                y = (x_ - mean.view(shape)) / torch.sqrt(var.view(shape) + eps) * gamma.view(shape) + \
                    beta.view(shape)
            elif op == "Relu":
                y = torch.relu(ins[0])
            elif op == "Add":
                y = ins[0] + ins[1]
            elif op == "GlobalAveragePool":
                y = ins[0].mean(dim=tuple(range(2, ins[0].dim())), keepdim=True)
            elif op == "Flatten":
                y = torch.flatten(ins[0], start_dim=int(a.get("axis", 1)))
            else:  # Gemm
                A, B = ins[0], ins[1]
                if a.get("transA", 0):
                    A = A.t()
                if a.get("transB", 0):
                    B = B.t()
                y = float(a.get("alpha", 1.0)) * (A @ B)
                if len(ins) > 2:
                    y = y + float(a.get("beta", 1.0)) * ins[2]
            env[node.output[0]] = y
        return env[self.output_name]
