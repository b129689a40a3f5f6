"""Training module construction with ``tvm.relax.training``.

The imported inference function (compiled at the training batch) becomes ``backbone``;
``SetupTrainer`` appends the loss and differentiates it into ``backbone_loss_adjoint``
(``(*inputs, *params, targets) -> (loss, (grad, ...))``). The optimizer is our own Relax
function rather than TVM's: TVM bakes the learning rate in as a constant, while a swarm changes
it per round, so here it is an input: ``optimizer(params, grads, states, lr) -> (params, states)``.
Everything is legalized to TIR and compiled for the artifact's target like the inference module.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from compiler.errors import ModelError

__all__ = ["Loss", "Optimizer", "TrainSettings", "build_training_module", "optimizer_state_shapes",
           "ADJOINT_FUNC", "OPTIMIZER_FUNC"]

ADJOINT_FUNC = "backbone_loss_adjoint"
OPTIMIZER_FUNC = "optimizer"
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


class Loss(StrEnum):
    CE = "ce"
    MSE = "mse"


class Optimizer(StrEnum):
    SGD = "sgd"
    ADAM = "adam"


@dataclass(frozen=True)
class TrainSettings:
    """What ``--train`` compiles: the loss, the optimizer, the default lr and the batch size."""

    loss: str = "ce"
    optimizer: str = "sgd"
    lr: float = 0.01
    batch: int = 32

    def __post_init__(self) -> None:
        # Validate early (and normalise enums to their string values for the manifest).
        object.__setattr__(self, "loss", Loss(self.loss).value)
        object.__setattr__(self, "optimizer", Optimizer(self.optimizer).value)
        if not (self.batch >= 1):
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if not (float(self.lr) > 0):
            raise ValueError(f"lr must be > 0, got {self.lr}")
        object.__setattr__(self, "lr", float(self.lr))
        object.__setattr__(self, "batch", int(self.batch))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def optimizer_state_shapes(optimizer: str,
                           param_shapes: list[tuple[int, ...]]) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every optimizer state tensor, in the order the compiled function takes."""
    if Optimizer(optimizer) is Optimizer.SGD:
        return [((), "int64")]
    return [((), "int64"), ((), "float32"), ((), "float32"),
            *[(s, "float32") for s in param_shapes], *[(s, "float32") for s in param_shapes]]


def _sgd_function(param_sinfo: list[Any]) -> Any:
    from tvm import relax
    from tvm.relax import op

    params = relax.Var("params", relax.TupleType(param_sinfo))
    grads = relax.Var("gradients", relax.TupleType(param_sinfo))
    states = relax.Var("optim_states", relax.TupleType([relax.TensorType((), "int64")]))
    lr = relax.Var("lr", relax.TensorType((), "float32"))
    bb = relax.BlockBuilder()
    with bb.function(OPTIMIZER_FUNC, [params, grads, states, lr]):
        with bb.dataflow():
            steps = bb.emit(op.add(relax.TupleGetItem(states, 0), relax.const(1, "int64")))
            new = []
            for i in range(len(param_sinfo)):
                p = bb.emit(relax.TupleGetItem(params, i))
                g = bb.emit(relax.TupleGetItem(grads, i))
                new.append(bb.emit(op.subtract(p, op.multiply(lr, g))))
            out_p = bb.emit_output(relax.Tuple(new))
            out_s = bb.emit_output(relax.Tuple([steps]))
        bb.emit_func_output(relax.Tuple([out_p, out_s]))
    return bb.get()[OPTIMIZER_FUNC]


def _adam_function(param_sinfo: list[Any]) -> Any:
    """Adam as in torch.optim.Adam (no weight decay, no amsgrad), lr as an input."""
    from tvm import relax
    from tvm.relax import op

    n = len(param_sinfo)
    f32 = relax.TensorType((), "float32")
    state_sinfo = [relax.TensorType((), "int64"), f32, f32, *param_sinfo, *param_sinfo]
    params = relax.Var("params", relax.TupleType(param_sinfo))
    grads = relax.Var("gradients", relax.TupleType(param_sinfo))
    states = relax.Var("optim_states", relax.TupleType(state_sinfo))
    lr = relax.Var("lr", f32)
    b1, b2 = ADAM_BETAS
    c = lambda v: relax.const(v, "float32")  # noqa: E731
    bb = relax.BlockBuilder()
    with bb.function(OPTIMIZER_FUNC, [params, grads, states, lr]):
        with bb.dataflow():
            steps = bb.emit(op.add(relax.TupleGetItem(states, 0), relax.const(1, "int64")))
            b1p = bb.emit(op.multiply(relax.TupleGetItem(states, 1), c(b1)))
            b2p = bb.emit(op.multiply(relax.TupleGetItem(states, 2), c(b2)))
            corr1 = bb.emit(op.subtract(c(1.0), b1p))
            corr2 = bb.emit(op.subtract(c(1.0), b2p))
            new_p, new_m, new_v = [], [], []
            for i in range(n):
                p = bb.emit(relax.TupleGetItem(params, i))
                g = bb.emit(relax.TupleGetItem(grads, i))
                m = bb.emit(relax.TupleGetItem(states, 3 + i))
                v = bb.emit(relax.TupleGetItem(states, 3 + n + i))
                m2 = bb.emit(op.add(op.multiply(c(b1), m), op.multiply(c(1 - b1), g)))
                v2 = bb.emit(op.add(op.multiply(c(b2), v), op.multiply(c(1 - b2), op.multiply(g, g))))
                m_hat = bb.emit(op.divide(m2, corr1))
                v_hat = bb.emit(op.divide(v2, corr2))
                step = bb.emit(op.multiply(lr, op.divide(m_hat, op.add(op.sqrt(v_hat), c(ADAM_EPS)))))
                new_p.append(bb.emit(op.subtract(p, step)))
                new_m.append(m2)
                new_v.append(v2)
            out_p = bb.emit_output(relax.Tuple(new_p))
            out_s = bb.emit_output(relax.Tuple([steps, b1p, b2p, *new_m, *new_v]))
        bb.emit_func_output(relax.Tuple([out_p, out_s]))
    return bb.get()[OPTIMIZER_FUNC]


def build_training_module(mod: Any, *, num_inputs: int, num_params: int, settings: TrainSettings) -> Any:
    """The legalized training IRModule (``backbone_loss_adjoint`` + ``optimizer``).

    ``mod["main"]`` is the imported model at batch ``settings.batch``: ``(*inputs, *params)``.
    """
    import tvm
    from tvm import relax
    from tvm.relax.training import SetupTrainer
    from tvm.relax.training import loss as rx_loss
    from tvm.relax.training import optimizer as rx_opt

    main = mod["main"]
    if num_params == 0:
        raise ModelError("the model has no trainable parameters", hint="compile without --train")
    ret = main.ret_ty
    if isinstance(ret, relax.TupleType):
        raise ModelError("--train supports single-output models only",
                         hint="export the training head as the only output")
    if not str(ret.dtype).startswith("float"):
        raise ModelError(f"--train needs a float output, got {ret.dtype}", hint="compile without --train")
    batch = settings.batch
    if Loss(settings.loss) is Loss.CE:
        if ret.ndim != 2:
            raise ModelError(f"--loss ce needs logits shaped (batch, classes), the output has rank "
                             f"{ret.ndim}",
                             hint="use --loss mse or export logits as a 2-D output")
        loss_obj = rx_loss.CrossEntropyLoss(reduction="mean")
        targets = relax.TensorType((batch,), "int64")
    else:
        loss_obj = rx_loss.MSELoss(reduction="mean")
        targets = relax.TensorType(ret.shape, ret.dtype)

    backbone = tvm.IRModule({"backbone": main.with_attr("global_symbol", "backbone")})
    for gv, func in mod.functions_items():
        if gv.name_hint != "main":
            backbone[gv] = func
    backbone = backbone.with_attrs({"param_num": num_params, "state_num": 0})
    # BatchNorm in inference form (running statistics are constants): SetupTrainer would otherwise
    # decompose it into training form with batch statistics, which the inference library never
    # uses and which would make gradients disagree with what the model computes at serving time.
    backbone = relax.transform.DecomposeOpsForInference("backbone")(backbone)
    # SetupTrainer needs some optimizer; it is replaced below by one that takes lr as an input.
    trainer = SetupTrainer(loss_obj, rx_opt.SGD(0.01), [ret, targets], legalize=False)
    try:
        full = trainer(backbone)
    except Exception as exc:
        raise ModelError(f"TVM could not differentiate the model: {' '.join(str(exc).split())[:300]}",
                         hint="an op in the model has no gradient in TVM; compile without --train") from None
    params_sinfo = [p.ty for p in full[ADJOINT_FUNC].params[num_inputs:num_inputs + num_params]]
    opt = _sgd_function if Optimizer(settings.optimizer) is Optimizer.SGD else _adam_function
    out = tvm.IRModule({ADJOINT_FUNC: full[ADJOINT_FUNC],
                        OPTIMIZER_FUNC: opt(params_sinfo).with_attr("global_symbol", OPTIMIZER_FUNC)})
    return relax.transform.LegalizeOps()(out)


def initial_state(optimizer: str, params: list[np.ndarray]) -> list[np.ndarray]:
    """The optimizer's state before the first step (numpy; stdlib-free helper for tests)."""
    shapes = optimizer_state_shapes(optimizer, [tuple(p.shape) for p in params])
    out = []
    for i, (shape, dtype) in enumerate(shapes):
        fill = 1.0 if (optimizer == "adam" and i in (1, 2)) else 0.0
        out.append(np.full(shape, fill, dtype=dtype))
    return out
