"""Sites on one machine: a backbone Mosquitto and one Mosquitto per site, each bridging the
leaders' topics to the backbone with the files in ``deploy/mosquitto/`` (site-bridge.conf,
backbone.conf); federation/PROTOCOL.md section 10. Used by ``fractal swarm --sites N`` and the
tests' ``site_brokers`` fixture."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from federation.broker import MAX_PACKET_SIZE, MosquittoBroker, start_mosquitto

__all__ = ["Sites", "start_sites", "deploy_conf", "site_names"]

DEPLOY = Path(__file__).resolve().parent / "mosquitto"


def deploy_conf(name: str, **subst: str) -> str:
    """A deploy/mosquitto file with its ``@KEY@`` placeholders filled, comments dropped."""
    text = (DEPLOY / name).read_text()
    for k, v in subst.items():
        text = text.replace(f"@{k}@", v)
    return "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))


def site_names(n: int) -> list[str]:
    return [f"site-{k + 1}" for k in range(n)]


@dataclass
class Sites:
    """The brokers :func:`start_sites` started; :meth:`close` stops them all."""

    backbone: MosquittoBroker
    sites: dict[str, MosquittoBroker] = field(default_factory=dict)

    def close(self) -> None:
        for b in [*self.sites.values(), self.backbone]:
            b.close()


def start_sites(names: list[str], *, workdir: Path | None = None) -> Sites:
    """A backbone broker and one bridged broker per site name (all on loopback, free ports)."""
    def wd(name: str) -> Path | None:
        return None if workdir is None else workdir / name

    backbone = start_mosquitto(workdir=wd("backbone"), max_packet_size=MAX_PACKET_SIZE,
                               extra_config=deploy_conf("backbone.conf"))
    out = Sites(backbone)
    try:
        for s in names:
            bridge = deploy_conf("site-bridge.conf", BACKBONE=f"127.0.0.1:{backbone.port}", SITE=s)
            out.sites[s] = start_mosquitto(workdir=wd(s), max_packet_size=MAX_PACKET_SIZE,
                                           extra_config=bridge)
    except BaseException:
        out.close()
        raise
    return out
