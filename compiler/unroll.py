"""Loop, Scan and If resolved in the preparation stage, before TVM's import.

TVM's Relax frontend has no Loop or Scan converter. When the number of iterations is known at
compile time (a constant trip count, a static sequence length), the loop is unrolled: the body is
copied once per iteration with its values renamed, the loop-carried values chained from one copy to
the next, the per-iteration (scan) outputs stacked with Unsqueeze + Concat. An ``If`` whose condition
is a constant (often only after unrolling: a condition on the iteration number) is replaced by the
branch taken.

Bounds: at most ``MAX_ITERATIONS`` iterations per loop and ``MAX_NODES`` copied nodes per model.
Every iteration is one more copy of the body in the compiled graph (no code is shared between
iterations), and TVM's import and build time grow with the node count; beyond the bounds the loop
is refused in one line (a rolled loop would need TVM's Relax control flow, which its ONNX
frontend does not emit).

A trip count (or initial condition) known only at run time is taken from the static leading dim of
the scan outputs when they declare one: the loop is unrolled that many times and the inputs are
checked at run time (:func:`compiler.convert_ops.guard_values`: other values stop inference).

Refused, each with the reason: a trip count or sequence length known only at run time otherwise, a Loop that
may end early on a condition computed at run time, zero iterations with scan outputs (an empty
tensor), opset 8's Scan with a sequence_lens input.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from compiler.errors import ModelError
from compiler.graphbuild import Builder, _const_inputs

__all__ = ["LOOP_OPS", "MAX_ITERATIONS", "MAX_NODES", "unroll_loops"]

LOOP_OPS = frozenset({"Loop", "Scan"})
MAX_ITERATIONS = 256
MAX_NODES = 8192  # nodes copied from loop bodies, over the whole model
_MAX_ROUNDS = 4  # nested loops: an unrolled body's own loops are unrolled in the next round
_GRAPH, _GRAPHS = 5, 10  # AttributeProto types holding subgraphs


def _opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _attr(node: Any, name: str, default: Any = None) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _subgraphs(node: Any) -> list[Any]:
    return [
        g
        for a in node.attribute
        for g in ([a.g] if a.type == _GRAPH else list(a.graphs) if a.type == _GRAPHS else [])
    ]


def _defined(graph: Any) -> set[str]:
    """Every name a (sub)graph defines: its inputs, initializers, node outputs, recursively."""
    out = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for n in graph.node:
        out.update(o for o in n.output if o)
        for sub in _subgraphs(n):
            out |= _defined(sub)
    return out


def _rename_graph(graph: Any, rename: Any) -> None:
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        vi.name = rename(vi.name)
    for t in graph.initializer:
        t.name = rename(t.name)
    for n in graph.node:
        _rename_node(n, rename)


def _rename_node(n: Any, rename: Any) -> None:
    for k, name in enumerate(n.input):
        n.input[k] = rename(name)
    for k, name in enumerate(n.output):
        n.output[k] = rename(name)
    for sub in _subgraphs(n):
        _rename_graph(sub, rename)


class _Emitter(Builder):
    """Nodes and initializers of one rewrite, with fresh names under ``prefix``."""

    def __init__(self, model: Any, prefix: str) -> None:
        super().__init__(model, prefix)
        self.opset = _opset(model)

    def unsqueeze(self, x: str, axis: int) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", [x, self.const(np.array([axis], np.int64), "axes")])
        return self.op("Unsqueeze", [x], axes=[axis])

    def stack(self, values: list[str], axis: int, out: str) -> None:
        """``values`` (same shape) stacked along a new ``axis`` into ``out``."""
        parts = [self.unsqueeze(v, axis) for v in values]
        if len(parts) == 1:
            self.op("Identity", parts, out=out)
        else:
            self.op("Concat", parts, out=out, axis=axis)

    def body(self, graph: Any, bound: dict[str, str], tag: str) -> dict[str, str]:
        """Copy ``graph``'s nodes once: its inputs are ``bound`` (formal -> value), every name it
        defines gets the prefix ``tag``, outer names stay. Returns formal output -> value."""
        from onnx import NodeProto

        local = _defined(graph)
        base = f"{self.prefix}/{tag}"

        def rename(name: str) -> str:
            if not name:
                return ""
            if name in bound:
                return bound[name]
            return f"{base}/{name}" if name in local else name

        for t in graph.initializer:
            copy = type(t)()
            copy.CopyFrom(t)
            copy.name = rename(t.name)
            self.inits.append(copy)
        for k, body_node in enumerate(graph.node):
            n = NodeProto()
            n.CopyFrom(body_node)
            n.name = f"{base}/{n.name or n.op_type}_{k}"
            _rename_node(n, rename)
            self.nodes.append(n)
        return {o.name: rename(o.name) for o in graph.output}


_const_values = _const_inputs  # initializers and Constant outputs (compiler/graphbuild.py)


def _static_shapes(model: Any) -> dict[str, list[int]]:
    from compiler.graphbuild import _static_shapes as shapes

    return shapes(model)


def _rank(graph_output: Any) -> int | None:
    tt = graph_output.type.tensor_type
    return len(tt.shape.dim) if graph_output.type.HasField("tensor_type") and tt.HasField("shape") else None


class _Budget:
    def __init__(self) -> None:
        self.nodes = 0

    def spend(self, label: str, iterations: int, body: Any) -> None:
        if iterations > MAX_ITERATIONS:
            raise ModelError(
                f"{label}: {iterations} iterations; loops are unrolled at compile time, up to "
                f"{MAX_ITERATIONS}",
                hint="shorten the loop or run it outside the model",
            )
        self.nodes += iterations * max(1, _count(body))
        if self.nodes > MAX_NODES:
            raise ModelError(
                f"{label}: unrolling the model's loops copies more than {MAX_NODES} nodes",
                hint="shorten the loops or run them outside the model",
            )


def _count(graph: Any) -> int:
    return sum(1 + sum(_count(s) for s in _subgraphs(n)) for n in graph.node)


# ------------------------------------------------------------------------------------------- Scan
def _scan(
    em: _Emitter,
    node: Any,
    label: str,
    shapes: dict[str, list[int]],
    consts: dict[str, np.ndarray],
    budget: _Budget,
) -> None:
    body = _attr(node, "body")
    m = int(_attr(node, "num_scan_inputs", 0))
    inputs = list(node.input)
    batched = em.opset < 9  # opset 8: a leading batch axis everywhere, then sequence_lens first
    if batched:
        lens = inputs.pop(0) if inputs else ""
        if lens:
            raise ModelError(
                f"{label}: opset 8's sequence_lens input (sequences of different lengths) is not supported",
                hint="re-export the model with opset 9 or newer",
            )
    n = len(inputs) - m
    if m < 1 or n < 0 or len(body.input) != n + m or len(body.output) < n:
        raise ModelError(
            f"{label}: {len(inputs)} inputs, num_scan_inputs={m} and a body of "
            f"{len(body.input)} inputs / {len(body.output)} outputs do not agree",
            hint="fix the model (onnx.checker shows the details)",
        )
    k = len(body.output) - n
    shift = 1 if batched else 0
    in_axes = list(_attr(node, "scan_input_axes", [0] * m)) if not batched else [0] * m
    in_dirs = list(_attr(node, "scan_input_directions", [0] * m))
    out_axes = list(_attr(node, "scan_output_axes", [0] * k)) if not batched else [0] * k
    out_dirs = list(_attr(node, "scan_output_directions", [0] * k))
    states, xs = inputs[:n], inputs[n:]
    lengths = set()
    for j, x in enumerate(xs):
        dims = shapes.get(x)
        if not dims or any(d <= 0 for d in dims):
            raise ModelError(
                f"{label}: the scan input {x!r} has no static shape ({dims}), so the number of "
                "iterations is not known at compile time",
                hint="fix the input shapes with --shape NAME=D0,D1,...",
            )
        in_axes[j] = in_axes[j] + len(dims) - shift if in_axes[j] < 0 else in_axes[j]
        lengths.add(dims[in_axes[j] + shift])
    if len(lengths) != 1:
        raise ModelError(
            f"{label}: the scan inputs have different lengths {sorted(lengths)}", hint="fix the model"
        )
    steps = lengths.pop()
    batch = [shapes[x][0] for x in xs][0] if batched else 1
    budget.spend(label, steps * batch, body)
    for j in range(k):
        if out_axes[j] < 0:
            rank = _rank(body.output[n + j])
            if rank is None:
                raise ModelError(
                    f"{label}: a negative scan_output_axes with a body output of unknown rank",
                    hint="give the body's outputs shapes or use a non-negative axis",
                )
            out_axes[j] += rank + 1
    finals: list[list[str]] = [[] for _ in range(n)]
    stacked: list[list[str]] = [[] for _ in range(k)]
    for b in range(batch):
        carried = [
            em.op("Gather", [s, em.const(np.array(b, np.int64), "b")], axis=0) if batched else s
            for s in states
        ]
        seqs = [
            em.op("Gather", [x, em.const(np.array(b, np.int64), "b")], axis=0) if batched else x for x in xs
        ]
        per_step: list[list[str]] = [[] for _ in range(k)]
        for t in range(steps):
            bound = {body.input[i].name: carried[i] for i in range(n)}
            for j, x in enumerate(seqs):
                idx = t if not in_dirs[j] else steps - 1 - t
                bound[body.input[n + j].name] = em.op(
                    "Gather", [x, em.const(np.array(idx, np.int64), "t")], axis=in_axes[j]
                )
            outs = em.body(body, bound, f"b{b}t{t}" if batched else f"t{t}")
            carried = [outs[body.output[i].name] for i in range(n)]
            for j in range(k):
                per_step[j].append(outs[body.output[n + j].name])
        for i in range(n):
            finals[i].append(carried[i])
        for j in range(k):
            values = per_step[j][::-1] if out_dirs[j] else per_step[j]
            stacked[j].append(em.name("scan") if batched else node.output[n + j])
            em.stack(values, out_axes[j], stacked[j][-1])
    for i, out in enumerate(node.output[:n]):
        if out:
            if batched:
                em.stack(finals[i], 0, out)
            else:
                em.op("Identity", [finals[i][0]], out=out)
    if batched:
        for j, out in enumerate(node.output[n:]):
            if out:
                em.stack(stacked[j], 0, out)


# ------------------------------------------------------------------------------------------- Loop
def _passes_condition(body: Any, consts: dict[str, np.ndarray]) -> bool:
    """True if the body's condition output is its condition input or a constant true (of the body
    or of the outer graph, through Identity): the loop then runs exactly its trip count (given a
    true or absent initial condition). torch.onnx exports a for loop as Identity(outer true)."""
    from onnx import numpy_helper

    cond_in, cond_out = body.input[1].name, body.output[0].name
    alias = {cond_in}
    true = {name for name, v in consts.items() if v.dtype == bool and v.size == 1 and bool(v.all())}
    for n in body.node:
        if n.op_type == "Identity":
            for group in (alias, true):
                if n.input[0] in group:
                    group.add(n.output[0])
        elif n.op_type == "Constant":
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            if value is not None and bool(np.all(numpy_helper.to_array(value))):
                true.add(n.output[0])
            else:
                true.discard(n.output[0])
    return cond_out in alias or cond_out in true


def _declared_steps(model: Any, node: Any, n: int, shapes: dict[str, list[int]]) -> int | None:
    """The iteration count the scan outputs' static leading dims agree on (None: no scan output
    with one, or they disagree). A scan output only cast (or copied) on its way to a declared
    model output takes that output's dims (shape inference runs forward only)."""
    users: dict[str, list[Any]] = {}
    for other in model.graph.node:
        for i in other.input:
            users.setdefault(i, []).append(other)
    firsts = set()
    for out in node.output[n:]:
        for _ in range(4):  # a short chain of Cast / Identity
            if not out or (shapes.get(out) or [0])[0] > 0 or len(users.get(out, [])) != 1 or \
                    users[out][0].op_type not in ("Cast", "Identity"):
                break
            out = users[out][0].output[0]
        if out and (shapes.get(out) or [0])[0] > 0:
            firsts.add(shapes[out][0])
    return firsts.pop() if len(firsts) == 1 else None


def _loop(em: _Emitter, node: Any, label: str, consts: dict[str, np.ndarray], budget: _Budget,
          shapes: dict[str, list[int]]) -> None:
    body = _attr(node, "body")
    trip, cond = (list(node.input) + ["", ""])[:2]
    states = list(node.input[2:])
    n = len(states)
    k = len(body.output) - 1 - n
    if len(body.input) != n + 2 or k < 0:
        raise ModelError(
            f"{label}: {n} loop-carried values and a body of {len(body.input)} inputs / "
            f"{len(body.output)} outputs do not agree",
            hint="fix the model",
        )
    declared = _declared_steps(em.model, node, n, shapes)
    if trip and declared is not None and (trip not in consts or (cond and cond not in consts)) and \
            _passes_condition(body, consts):
        # a run-time trip count (or initial condition) the static scan outputs fix: unrolled for
        # that count, the inputs checked at run time (any other value stops inference)
        _loop_guarded(em, node, label, consts, budget, declared)
        return
    if not trip:
        raise ModelError(
            f"{label}: no trip count (a while loop); loops are unrolled at compile time, which "
            "needs the number of iterations",
            hint="give the Loop a constant trip count",
        )
    if trip not in consts:
        raise ModelError(
            f"{label}: the trip count {trip!r} is known only at run time, and no scan output of static "
            "length fixes it; loops are unrolled at compile time",
            hint="make the trip count a constant of the model",
        )
    if cond and cond not in consts:
        raise ModelError(
            f"{label}: the initial condition {cond!r} is known only at run time",
            hint="make it a constant, or drop it (an empty input)",
        )
    steps = int(consts[trip])
    if cond and not bool(np.all(consts[cond])):
        steps = 0
    if steps > 0 and not _passes_condition(body, consts):
        raise ModelError(
            f"{label}: the body computes its own continue condition, so the loop may end early at run time",
            hint="let the body pass its condition through unchanged",
        )
    steps = max(steps, 0)
    if steps == 0 and k:
        raise ModelError(
            f"{label}: runs zero times, so its scan outputs are empty tensors, which are not supported",
            hint="give the loop at least one iteration",
        )
    _unrolled(em, node, label, budget, steps, list(node.output))


def _loop_guarded(em: _Emitter, node: Any, label: str, consts: dict[str, np.ndarray], budget: _Budget,
                  steps: int) -> None:
    """``node`` unrolled ``steps`` times, each output guarded: its run-time trip count must be
    ``steps`` and its run-time initial condition true (:func:`compiler.convert_ops.guard_values`)."""
    from compiler.convert_ops import guard_values

    trip, cond = (list(node.input) + ["", ""])[:2]
    if (trip in consts and int(consts[trip]) != steps) or (cond in consts and not bool(np.all(consts[cond]))):
        raise ModelError(f"{label}: the scan outputs have {steps} rows, which its trip count and "
                         "condition do not give", hint="fix the model")
    want = {name: np.array(v) for name, v in ((trip, steps), (cond, 1)) if name and name not in consts}
    values = [em.name("unguarded") if o else "" for o in node.output]
    _unrolled(em, node, label, budget, steps, values)
    for value, out in zip(values, node.output, strict=True):
        if out:
            guard_values(em, [value], [want], out)


def _unrolled(em: _Emitter, node: Any, label: str, budget: _Budget, steps: int, outputs: list[str]) -> None:
    """``node``'s body copied ``steps`` times into ``outputs`` (the condition passes through,
    checked by the caller)."""
    body = _attr(node, "body")
    states = list(node.input[2:])
    n = len(states)
    k = len(body.output) - 1 - n
    budget.spend(label, steps, body)
    carried = states
    per_step: list[list[str]] = [[] for _ in range(k)]
    true = em.const(np.array(True), "cond")
    for t in range(steps):
        bound = {body.input[0].name: em.const(np.array(t, np.int64), "iter"), body.input[1].name: true}
        bound.update({body.input[2 + i].name: carried[i] for i in range(n)})
        outs = em.body(body, bound, f"t{t}")
        carried = [outs[body.output[1 + i].name] for i in range(n)]
        for j in range(k):
            per_step[j].append(outs[body.output[1 + n + j].name])
    for i, out in enumerate(outputs[:n]):
        if out:
            em.op("Identity", [carried[i]], out=out)
    for j, out in enumerate(outputs[n:]):
        if out:
            em.stack(per_step[j], 0, out)


# --------------------------------------------------------------------------------------------- If
def _if(em: _Emitter, node: Any, taken: bool) -> None:
    branch = _attr(node, "then_branch" if taken else "else_branch")
    outs = em.body(branch, {}, "then" if taken else "else")
    for formal, out in zip(branch.output, node.output, strict=False):
        if out:
            em.op("Identity", [outs[formal.name]], out=out)


def _const_if(node: Any, consts: dict[str, np.ndarray]) -> bool:
    return node.op_type == "If" and node.domain in ("", "ai.onnx") and node.input[0] in consts


# -------------------------------------------------------------------------------------------- step
def unroll_loops(model: Any, final: bool = True) -> bool:
    """Unroll every Loop / Scan (and inline every If on a constant condition) of the main graph,
    again in the unrolled bodies, up to a fixed nesting depth. ``final`` False (before the opset
    upgrade): only opset 8's batched Scan, which onnx's version converter rewrites wrongly."""
    changed = False
    budget = _Budget()
    for _ in range(_MAX_ROUNDS):
        if not _unroll_once(model, final, budget):
            return changed
        changed = True
        if final:
            from compiler.graphbuild import fold_constants

            fold_constants(model)  # the iteration numbers fold: conditions, indices inside the copies
    left = next((n.op_type for n in model.graph.node if n.op_type in LOOP_OPS), None)
    if final and left is not None:
        raise ModelError(
            f"{left}: loops nested more than {_MAX_ROUNDS} deep are not unrolled",
            hint="flatten the loops or run them outside the model",
        )
    return changed


def _wanted(node: Any, final: bool, opset: int, consts: dict[str, np.ndarray]) -> bool:
    if node.domain not in ("", "ai.onnx"):
        return False
    if not final:
        return node.op_type == "Scan" and opset < 9
    return node.op_type in LOOP_OPS or _const_if(node, consts)


def _unroll_once(model: Any, final: bool, budget: _Budget) -> bool:
    g = model.graph
    opset = _opset(model)
    if not any(n.op_type in LOOP_OPS | {"If"} for n in g.node):
        return False
    consts = _const_values(model)
    if not any(_wanted(n, final, opset, consts) for n in g.node):
        return False
    shapes = _static_shapes(model)
    new_nodes = []
    for i, node in enumerate(g.node):
        if not _wanted(node, final, opset, consts):
            new_nodes.append(node)
            continue
        label = f"{node.op_type} at node {node.name or f'#{i}'!r}"
        em = _Emitter(model, f"{node.name or node.op_type}_{i}")
        if node.op_type == "Scan":
            _scan(em, node, label, shapes, consts, budget)
        elif node.op_type == "Loop":
            _loop(em, node, label, consts, budget, shapes)
        else:
            _if(em, node, bool(np.all(consts[node.input[0]])))
        new_nodes.extend(em.nodes)
        g.initializer.extend(em.inits)
    del g.node[:]
    g.node.extend(new_nodes)
    del g.value_info[:]
    return True
