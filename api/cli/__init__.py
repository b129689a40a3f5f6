"""The `fractal` command line: one typer app, one module per verb group.

Each verb group lives in its own module (``compile.py``, ``node.py``, ``fleet.py``,
``bench.py``, ...) and registers itself on :data:`app` at import time. :func:`main` turns
every project error into one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import importlib
import sys

import typer

from api.cli.errors import format_error, is_user_error
from fractal.extras import missing_compiler

__all__ = ["app", "main"]

app = typer.Typer(
    name="fractal",
    help="fractal-edge: compile ONNX models with TVM for edge boards, train them as a swarm, serve them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Verb modules, imported for their side effect of registering commands on `app`.
_VERB_MODULES = ("compile", "node", "fleet", "image", "boot", "bench")


def _register() -> None:
    for name in _VERB_MODULES:
        try:
            importlib.import_module(f"api.cli.{name}")
        except ModuleNotFoundError as exc:  # a verb group not written yet
            if exc.name != f"api.cli.{name}":
                raise


_register()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `fractal` console script."""
    from fractal.heap import tune_allocator

    tune_allocator()  # before any frame buffer exists (fractal/heap.py)
    try:
        app(args=argv)  # standalone: click handles usage errors (exit 2) and --help itself
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # the CLI boundary: a user error is one line and exit 1
        if (missing := missing_compiler(exc)) is not None:  # a node install running `fractal compile`
            exc = missing
        if is_user_error(exc):
            print(format_error(exc), file=sys.stderr)
            sys.exit(1)
        raise
