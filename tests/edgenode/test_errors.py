"""The node's error tree lives in edgenode/errors.py (as every layer's does), re-exported by the
package root; edgenode.common keeps only its helpers."""

from __future__ import annotations

import edgenode
import edgenode.common as common
import edgenode.errors as errors
from fractal import FractalError


def test_the_node_errors_live_in_edgenode_errors():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert cls.__module__ == "edgenode.errors", name
        assert issubclass(cls, errors.NodeError) and issubclass(cls, FractalError), name
        assert getattr(edgenode, name) is cls, name
        assert name not in common.__all__, name
    e = errors.RoundFailed("member m2 left", member="m2", hint="start the round again")
    assert (str(e), e.member, e.hint) == ("member m2 left", "m2", "start the round again")
