"""`fractal bench allreduce`: ring vs star allreduce and raw broker throughput over MQTT."""

from __future__ import annotations

import typer

from api.cli.bench import bench_app, echo_result

__all__ = ["bench_allreduce"]


@bench_app.command("allreduce")
def bench_allreduce(
    nodes: int = typer.Option(4, "--nodes", "-n",
                              help="Members, each a separate OS process with its own MQTT link."),
    size: int = typer.Option(1_000_000, "--size", help="Elements (float32) per member vector."),
    broker: str | None = typer.Option(None, "--broker",
                                      help="mqtt://[user:pass@]host:port (default: start a Mosquitto)."),
    compression: str = typer.Option("none", "--compression", "-c", help="none, fp16, int8 or topk."),
    max_payload: int = typer.Option(256 * 1024, "--max-payload", min=64, max=1 << 20,
                                    help="Bytes per MQTT message (up to 1 MiB: members drop payloads "
                                    "over the swarm's 2 MiB limit)."),
    repeats: int = typer.Option(3, "--repeats", help="Timed calls per engine (the median is reported)."),
    signed: bool = typer.Option(False, "--signed", help="Also time the ring with authenticated frames "
                                "(pairwise AES-GMAC, same members, alternating repeat by repeat; reports "
                                "signed_seconds, signed_overhead and the per-repeat signed_paired_overhead "
                                "with its 95% interval)."),
    algorithm: str = typer.Option("auto", "--algorithm",
                                  help="auto (direct path for small float32 vectors, else the ring), "
                                  "ring or direct."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Time one ring allreduce (and the star baseline) of --size floats across --nodes members."""
    from bench.allreduce import run_allreduce_bench
    from federation.errors import FederationError
    from federation.messages import Compression

    try:
        Compression(compression)
    except ValueError:
        raise FederationError(f"unknown compression {compression!r}",
                              hint="use one of: " + ", ".join(c.value for c in Compression)) from None
    result = run_allreduce_bench(nodes, size, broker_url=broker, compression=compression,
                                 max_payload=max_payload, repeats=repeats, signed=signed,
                                 algorithm=algorithm)
    echo_result(result, as_json)
