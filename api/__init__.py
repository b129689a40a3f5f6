"""api: the node's HTTP face (Open Inference Protocol v2, samples, metrics) and the fleet service."""

from fractal import __version__

__all__ = ["__version__", "create_node_app"]


def __getattr__(name: str):
    # Lazy: `api.cli` must import without pulling FastAPI/numpy in for `fractal --help`.
    if name == "create_node_app":
        from api.node_app import create_node_app

        return create_node_app
    raise AttributeError(name)
