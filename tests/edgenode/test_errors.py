"""The node's error tree lives in edgenode/errors.py (as every layer's does); the old import path
``edgenode.common`` still gives the very same classes (modules written against it keep working)."""

from __future__ import annotations

import edgenode
import edgenode.common as common
import edgenode.errors as errors
from fractal import FractalError


def test_the_node_errors_live_in_edgenode_errors_and_the_old_path_is_the_same_classes():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert cls.__module__ == "edgenode.errors", name
        assert issubclass(cls, errors.NodeError) and issubclass(cls, FractalError), name
        assert getattr(common, name) is cls and getattr(edgenode, name) is cls, name
    e = errors.RoundFailed("member m2 left", member="m2", hint="start the round again")
    assert (str(e), e.member, e.hint) == ("member m2 left", "m2", "start the round again")
