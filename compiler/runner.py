"""Run one artifact on one batch of inputs: ``python -m compiler.runner ARTIFACT IN.npz OUT.npz``
(several ``ARTIFACT IN OUT`` triples in one process: tvm is imported once, which under emulation
is most of the time).

This is the program :mod:`compiler.emulate` starts under qemu-user inside the aarch64 sysroot,
so it imports only the standard library, numpy and :mod:`compiler.artifact` (tvm, numpy). The
npz keys are the model's input and output names. Errors are one ``error: ...`` line on stderr
and exit status 1, which the emulator relays.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Load each artifact, run ``infer`` on its npz inputs, write the outputs; 0 on success (the
    first failure stops the run)."""
    ap = argparse.ArgumentParser(prog="python -m compiler.runner", description=__doc__)
    ap.add_argument("artifact", help="artifact directory (from `fractal compile`)")
    ap.add_argument("inputs", help="npz with one array per model input")
    ap.add_argument("outputs", help="npz to write, one array per model output")
    ap.add_argument("more", nargs="*", help="further ARTIFACT INPUTS OUTPUTS triples, run in order")
    args = ap.parse_args(argv)
    if len(args.more) % 3:
        ap.error("the extra arguments must be ARTIFACT INPUTS OUTPUTS triples")
    triples = [(args.artifact, args.inputs, args.outputs),
               *((args.more[i], args.more[i + 1], args.more[i + 2]) for i in range(0, len(args.more), 3))]
    for artifact, inputs, outputs in triples:
        code = _run_one(artifact, inputs, outputs)
        if code:
            return code
    return 0


def _run_one(artifact: str, inputs_npz: str, outputs_npz: str) -> int:
    """One artifact on one npz of inputs; 0 on success, 1 with an ``error:`` line."""
    import numpy as np

    from compiler.artifact import load_artifact
    from compiler.errors import CompilerError

    t0 = time.perf_counter()
    try:
        art = load_artifact(artifact)
        with np.load(inputs_npz) as npz:
            inputs = {k: npz[k] for k in npz.files}
        t1 = time.perf_counter()
        outputs = art.infer(inputs)
        t2 = time.perf_counter()
    except CompilerError as exc:
        hint = f" (help: {exc.hint})" if getattr(exc, "hint", None) else ""
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # unreadable npz
        print(f"error: cannot read {inputs_npz}: {exc}", file=sys.stderr)
        return 1
    arrays: dict[str, Any] = {k: np.asarray(v) for k, v in outputs.items()}
    np.savez(outputs_npz, **arrays)
    print(f"runner: {artifact}: load {t1 - t0:.2f}s infer {t2 - t1:.3f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
