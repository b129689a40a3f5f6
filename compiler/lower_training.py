"""The optimizer operators of ``ai.onnx.preview.training`` (Adagrad, Adam, Momentum) as standard
operators, in the preparation stage (before the opset upgrade: such a model may import no default
opset at all, and one is added).

Each is an element-wise update of the tensors it is given (X, G and the optimizer's state) by a
scalar learning rate R and step count T, as ONNX defines them (onnx.reference's implementations):
Mul / Add / Sqrt / Div / Pow / Where. Several tensors in one node are updated independently.
``Gradient`` (automatic differentiation of a subgraph) is refused by name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from compiler.errors import ModelError

__all__ = ["TRAINING_DOMAIN", "TRAINING_OPS", "lower_training"]

TRAINING_DOMAIN = "ai.onnx.preview.training"
TRAINING_OPS = frozenset({"Adagrad", "Adam", "Momentum"})
_DEFAULT_OPSET = 17  # the default-domain opset added when the model imports none


def _attr(node: Any, name: str, default: Any) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            value = onnx.helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


def _scalar(bld: Any, value: float) -> str:
    return str(bld.const(np.array(value, np.float32), "k"))


def _common(bld: Any, node: Any) -> tuple[str, str, str]:
    """(R, T as float, T > 0)."""
    r, t = node.input[:2]
    t_f = bld.op("Cast", [t], to=1)
    started = bld.op("Greater", [t_f, _scalar(bld, 0.0)])
    return r, t_f, started


def _regularized(bld: Any, x: str, g: str, norm: float) -> str:
    return str(bld.op("Add", [bld.op("Mul", [x, _scalar(bld, norm)]), g]))


def _adagrad(bld: Any, node: Any) -> None:
    n = (len(node.input) - 2) // 3
    decay = float(_attr(node, "decay_factor", 0.0))
    eps, norm = float(_attr(node, "epsilon", 0.0)), float(_attr(node, "norm_coefficient", 0.0))
    r, t_f, _ = _common(bld, node)
    rate = bld.op("Div", [r, bld.op("Add", [_scalar(bld, 1.0), bld.op("Mul", [t_f, _scalar(bld, decay)])])])
    for i in range(n):
        x, g, h = (node.input[2 + k * n + i] for k in range(3))
        g_reg = _regularized(bld, x, g, norm)
        h_new = bld.op("Add", [h, bld.op("Mul", [g_reg, g_reg])], out=node.output[n + i] or None)
        scale = bld.op("Add", [bld.op("Sqrt", [h_new]), _scalar(bld, eps)])
        step = bld.op("Div", [bld.op("Mul", [rate, g_reg]), scale])
        bld.op("Sub", [x, step], out=node.output[i] or None)


def _adam(bld: Any, node: Any) -> None:
    n = (len(node.input) - 2) // 4
    alpha, beta = float(_attr(node, "alpha", 0.9)), float(_attr(node, "beta", 0.999))
    eps, norm = float(_attr(node, "epsilon", 0.0)), float(_attr(node, "norm_coefficient", 0.0))
    post = float(_attr(node, "norm_coefficient_post", 0.0))
    r, t_f, started = _common(bld, node)
    # bias correction r * sqrt(1 - beta^t) / (1 - alpha^t), only once T > 0
    one = _scalar(bld, 1.0)
    num = bld.op("Sqrt", [bld.op("Sub", [one, bld.op("Pow", [_scalar(bld, beta), t_f])])])
    den = bld.op("Sub", [one, bld.op("Pow", [_scalar(bld, alpha), t_f])])
    safe_den = bld.op("Where", [started, den, one])
    rate = bld.op("Where", [started, bld.op("Div", [bld.op("Mul", [r, num]), safe_den]), r])
    for i in range(n):
        x, g, v, h = (node.input[2 + k * n + i] for k in range(4))
        g_reg = _regularized(bld, x, g, norm)
        v_new = bld.op(
            "Add",
            [bld.op("Mul", [v, _scalar(bld, alpha)]), bld.op("Mul", [g_reg, _scalar(bld, 1 - alpha)])],
            out=node.output[n + i] or None,
        )
        h_new = bld.op(
            "Add",
            [
                bld.op("Mul", [h, _scalar(bld, beta)]),
                bld.op("Mul", [bld.op("Mul", [g_reg, g_reg]), _scalar(bld, 1 - beta)]),
            ],
            out=node.output[2 * n + i] or None,
        )
        scale = bld.op("Add", [bld.op("Sqrt", [h_new]), _scalar(bld, eps)])
        x_new = bld.op("Sub", [x, bld.op("Mul", [rate, bld.op("Div", [v_new, scale])])])
        bld.op("Mul", [x_new, _scalar(bld, 1 - post)], out=node.output[i] or None)


def _momentum(bld: Any, node: Any, label: str) -> None:
    n = (len(node.input) - 2) // 3
    alpha, beta = float(_attr(node, "alpha", 0.0)), float(_attr(node, "beta", 0.0))
    norm, mode = float(_attr(node, "norm_coefficient", 0.0)), _attr(node, "mode", "standard")
    if mode not in ("standard", "nesterov"):
        raise ModelError(
            f"{label}: mode {mode!r}; ONNX defines 'standard' and 'nesterov'", hint="fix the model"
        )
    r, _, started = _common(bld, node)
    beta_t = bld.op("Where", [started, _scalar(bld, beta), _scalar(bld, 1.0)])
    for i in range(n):
        x, g, v = (node.input[2 + k * n + i] for k in range(3))
        g_reg = _regularized(bld, x, g, norm)
        v_new = bld.op(
            "Add",
            [bld.op("Mul", [v, _scalar(bld, alpha)]), bld.op("Mul", [g_reg, beta_t])],
            out=node.output[n + i] or None,
        )
        step = (
            v_new
            if mode == "standard"
            else bld.op("Add", [g_reg, bld.op("Mul", [v_new, _scalar(bld, alpha)])])
        )
        bld.op("Sub", [x, bld.op("Mul", [r, step])], out=node.output[i] or None)


def lower_training(model: Any) -> bool:
    """Rewrite every Adagrad / Adam / Momentum node; True if any was."""
    import onnx

    from compiler.graphbuild import Builder as _Builder
    from compiler.graphbuild import _replace_nodes

    g = model.graph
    if not any(n.domain == TRAINING_DOMAIN for n in g.node):
        return False
    new_nodes = []
    for i, node in enumerate(g.node):
        if node.domain != TRAINING_DOMAIN:
            new_nodes.append(node)
            continue
        label = f"{TRAINING_DOMAIN}::{node.op_type} at node {node.name or f'#{i}'!r}"
        if node.op_type not in TRAINING_OPS:
            raise ModelError(
                f"{label} is not supported (only the optimizers Adagrad, Adam and Momentum are)",
                hint="compute gradients with --train (the project's own training) instead",
            )
        bld = _Builder(model, f"{node.name or node.op_type}_{i}")
        if node.op_type == "Adagrad":
            _adagrad(bld, node)
        elif node.op_type == "Adam":
            _adam(bld, node)
        else:
            _momentum(bld, node, label)
        new_nodes.extend(bld.nodes)
        g.initializer.extend(bld.inits)
    _replace_nodes(g, new_nodes)
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        model.opset_import.add(domain="", version=_DEFAULT_OPSET)
    kept = [o for o in model.opset_import if o.domain != TRAINING_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    model.ir_version = max(model.ir_version, onnx.helper.find_min_ir_version_for(list(model.opset_import)))
    return True
