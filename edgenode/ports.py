"""What the edge node needs from its collaborators, stated as ``typing.Protocol``s.

``EdgeNode``, ``ModelHolder`` and ``run_round`` are typed with these, not with the concrete
classes, so a board can plug in another engine (e.g. the C runtime) and tests plug in fakes
(``tests/edgenode/fakes.py`` is checked against them by mypy in ``make check``):

* :class:`Engine`: a loaded artifact (``compiler.artifact.Artifact``): specs, parameters,
  inference (validating inputs: ``compiler.artifact.check_inputs`` is the only validator) and
  an optional :class:`Trainer`.
* :class:`Trainer`: the compiled training step (``compiler.trainstep.Trainer``).
* :class:`Collective`: the allreduce among members (``federation.ring.RingAllreduce``).
* :data:`Link`: the MQTT connection, :class:`federation.transport.PubSubLink` (the one Protocol
  of every user of it; ``federation.mqtt.MqttLink``, ``federation.signed.SignedLink``).
* :class:`Updater`: the device the node was booted from (``firmware.ota.DeviceUpdates``).
* :class:`StepRunner`: runs a round's steps elsewhere (``edgenode.trainworker.TrainingWorker``, a
  worker process that also hosts the node's collective).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from federation.transport import Publication, PubSubLink

__all__ = ["Spec", "TuningFacts", "ManifestInfo", "Trainer", "Engine", "Collective", "StepRunner", "Link",
           "Publication", "Updater"]


class Spec(Protocol):
    """Name, shape (batch dim included) and dtype of a model input or output."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str: ...


class TuningFacts(Protocol):
    @property
    def tuned(self) -> bool: ...


class ManifestInfo(Protocol):
    """The part of the artifact manifest the node reports."""

    @property
    def preset(self) -> str: ...

    @property
    def tvm_version(self) -> str: ...

    @property
    def tuning(self) -> TuningFacts: ...

    @property
    def batched(self) -> bool: ...  # False: the inputs have no batch dimension (exact shapes)


class Trainer(Protocol):
    """Loss + gradients and the optimizer step at a fixed compiled batch."""

    @property
    def batch(self) -> int: ...

    @property
    def loss(self) -> str: ...  # "ce" or "mse"

    def loss_and_grad(self, params: list[np.ndarray], x: Any,
                      y: np.ndarray) -> tuple[float, list[np.ndarray]]: ...

    def init_state(self, params: list[np.ndarray]) -> list[np.ndarray]: ...

    def apply(self, params: list[np.ndarray], grads: list[np.ndarray], state: list[np.ndarray],
              lr: float | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]: ...


class Engine(Protocol):
    """A loaded model: inference on a parameter set, and (optionally) its trainer."""

    @property
    def name(self) -> str: ...

    @property
    def manifest(self) -> ManifestInfo: ...

    @property
    def inputs(self) -> Sequence[Spec]: ...

    @property
    def outputs(self) -> Sequence[Spec]: ...

    @property
    def param_names(self) -> list[str]: ...

    @property
    def params(self) -> list[np.ndarray]: ...

    @property
    def trainer(self) -> Trainer | None: ...

    def prepare_params(self, params: list[np.ndarray]) -> Any:
        """Convert a parameter set once for many ``infer`` calls (opaque to the node)."""
        ...

    def infer(self, inputs: Mapping[str, Any], params: Any = None) -> dict[str, np.ndarray]:
        """Validate ``inputs`` (InputError naming the problem) and run the model on ``params``."""
        ...


class Collective(Protocol):
    """Allreduce and broadcast among the members of a round (bit-identical results everywhere)."""

    def allreduce(self, vec: np.ndarray, *, group: list[str], tag: str, op: Any = "mean",
                  timeout: float = 30.0, compression: Any = ...,
                  clip_norm: float | None = None, claims: np.ndarray | None = None,
                  screen: Any = None, algorithm: str = "auto") -> np.ndarray: ...

    def broadcast(self, vec: np.ndarray | None, *, root: str, group: list[str], tag: str,
                  timeout: float = 30.0) -> np.ndarray: ...

    def exchange(self, vec: np.ndarray, *, group: list[str], tag: str, timeout: float = 30.0,
                 compression: Any = "none") -> np.ndarray:
        """Every member's vector, sent directly to every other member: ``(n, L)`` in ring order
        (with ``compression``: encoded with error feedback, every row decoded alike)."""
        ...

    def reset_feedback(self) -> None: ...

    def abort(self, tag: str, peers: list[str], reason: str) -> None:
        """Tell ``peers`` that the collective ``tag`` is void (they stop waiting at once)."""
        ...

    def cancel(self, reason: str) -> bool:
        """Fail the collective running right now (a fleet abort frees a blocked member)."""
        ...

    def close(self) -> None: ...


class StepRunner(Protocol):
    """A round's steps (``federation.steps.train_steps``) run elsewhere, with its own trainer
    and collective: same inputs, same bits as running it on the round thread."""

    def run_steps(self, plan: Any, *, node_id: str, params: list[np.ndarray], samples: Any,
                  rng: np.random.Generator, contributors: list[bool], abort: Any,
                  on_step: Callable[[int, float], None] | None = None
                  ) -> tuple[list[np.ndarray], list[float], dict[str, str]]: ...


# The broker connection (publish, subscribe, reconnect hook, a transport for the collective):
# federation's one publish/subscribe Protocol, under the name the node's modules use.
Link = PubSubLink


class Updater(Protocol):
    """The device a node runs from: its image report, and updates that take effect at the next boot."""

    def report(self) -> dict[str, Any] | None:
        """{version, slot, state, previous, update} (``federation.messages.ImageInfo`` fields)."""
        ...

    def last_update_id(self) -> str | None: ...

    def begin(self, update_id: str, kind: str, version: str) -> None: ...

    def fail(self, update_id: str, kind: str, version: str, error: str | BaseException) -> None:
        """Record a refusal (an exception is written as its message and how to fix it)."""
        ...

    def update(self, update_id: str, url: str, image_id: str, *, max_bytes: int = ...) -> Any:
        """Download, verify and flash the image into the inactive slot (raises on any refusal)."""
        ...

    def rollback(self, rollback_id: str) -> dict[str, Any]:
        """Make the previous good slot active (raises when there is none)."""
        ...
