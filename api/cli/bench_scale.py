"""`fractal bench scale`: flat ring vs star vs hierarchical ring on a modelled network, in one process."""

from __future__ import annotations

import typer

from api.cli.bench import bench_app, echo_result

__all__ = ["bench_scale"]


@bench_app.command("scale")
def bench_scale(
    nodes: int = typer.Option(100, "--nodes", "-n", help="Simulated members (threads of this process)."),
    group: int = typer.Option(16, "--group", help="Largest group of the hierarchy (one ring each; the "
                               "fleet's cut: near-equal groups, at most 64 of them)."),
    elements: int = typer.Option(16384, "--elements",
                                  help="float32 elements per member (M = 4 x elements bytes)."),
    uplink: float = typer.Option(65536.0, "--uplink", help="Each node's uplink B, bytes/s."),
    latency: float = typer.Option(0.001, "--latency", help="A broker's one-way latency alpha, seconds."),
    relay: float | None = typer.Option(None, "--relay", help="Each broker's relay throughput, bytes/s "
                                       "(default 1000 x --uplink)."),
    loss: float = typer.Option(0.0, "--loss", help="Probability a frame is lost (the session resends it)."),
    max_payload: int = typer.Option(2048, "--max-payload", min=256, max=1 << 20, help="Bytes per frame."),
    star: bool = typer.Option(True, "--star/--no-star",
                              help="Also model the star baseline (slow past 500 nodes)."),
    flat: bool = typer.Option(True, "--flat/--no-flat", help="Also model the flat ring (2(N-1) N frames: "
                              "about ten minutes at 1,000 nodes)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Model one round's mean through the real ring, session and aggregator code; print the
    modelled round times (flat, star, hierarchical) against the bandwidth bound."""
    from bench.scale import run_scale_bench

    if nodes > 5000:
        raise typer.BadParameter("--nodes is at most 5000 (one thread per member)")
    if not uplink > 0 or latency < 0 or (relay is not None and not relay > 0) or not 0 <= loss < 1:
        raise typer.BadParameter("--uplink and --relay must be > 0, --latency >= 0, --loss in [0, 1)")
    result = run_scale_bench(nodes, group=group, elements=elements, uplink_bps=uplink, latency_s=latency,
                             relay_bps=relay, loss=loss, max_payload=max_payload, star=star, flat=flat)
    echo_result(result, as_json)
