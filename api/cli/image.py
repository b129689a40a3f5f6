"""`fractal image ...`: build, sign, verify and flash device images (see firmware/)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from api.cli import app

__all__ = ["image_app"]

image_app = typer.Typer(
    help="Signed device images: keygen, build, verify, info, flash, status, rollback.", no_args_is_help=True
)
app.add_typer(image_app, name="image")


@image_app.command("keygen")
def keygen(
    out: Path = typer.Option(..., "--out", help="Private key path; the public key goes to OUT.pub."),
) -> None:
    """Write a new ed25519 signing key pair (KEY, mode 0600, and KEY.pub)."""
    from firmware.keys import key_id, load_public
    from firmware.keys import keygen as _keygen

    priv, pub = _keygen(out)
    typer.echo(f"wrote {priv} and {pub} (key id {key_id(load_public(pub))})")


@image_app.command("build")
def build(
    artifact: Path = typer.Argument(..., help="Artifact directory written by `fractal compile`."),
    board: str = typer.Option(
        ..., "--board", help="Board preset (x86_64, rpi4, rpi5, aarch64, riscv64, ...)."
    ),
    key: Path = typer.Option(..., "--key", help="Private signing key (`fractal image keygen`)."),
    out: Path = typer.Option(..., "--out", help="Image file to write."),
    version: str = typer.Option(..., "--version", help="Semantic version of the image, e.g. 1.2.0."),
    rollback_index: int = typer.Option(
        0,
        "--rollback-index",
        help="Anti-rollback counter: devices refuse images below the highest index they have booted.",
    ),
    add_key: list[Path] = typer.Option(
        [], "--add-key", help="Public key the device will trust after this image (key rotation); repeatable."
    ),
) -> None:
    """Build one signed image of a compiled artifact for a board."""
    import time

    from firmware.image import build_image

    t0 = time.perf_counter()
    path = build_image(
        artifact,
        board=board,
        key=key,
        out=out,
        version=version,
        rollback_index=rollback_index,
        add_keys=list(add_key),
    )
    typer.echo(
        f"wrote {path} ({path.stat().st_size} bytes, board {board}, version {version}) "
        f"in {time.perf_counter() - t0:.2f} s"
    )


@image_app.command("verify")
def verify(
    image: Path = typer.Argument(..., help="Image file."),
    pubkey: list[Path] = typer.Option(..., "--pubkey", help="Trusted public key; repeatable."),
) -> None:
    """Check the image's signature and every member's sha256."""
    from firmware.image import load_trusted, open_image

    img = open_image(image, load_trusted(list(pubkey)))
    typer.echo(
        f"ok: {image} board {img.board} version {img.version} signed by {img.signer}, "
        f"{len(img.members)} members verified"
    )


@image_app.command("info")
def info(
    image: Path = typer.Argument(..., help="Image file."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole manifest as JSON."),
) -> None:
    """Show an image's manifest (the signature is NOT checked; use `verify`)."""
    from firmware.image import read_unverified

    m, _, _, size = read_unverified(image)
    if as_json:
        typer.echo(json.dumps(m, indent=2, sort_keys=True))
        return
    typer.echo(f"image {image} ({size} bytes, format {m.get('format_version')}, signature not checked)")
    for k in (
        "board",
        "arch",
        "version",
        "rollback_index",
        "artifact_name",
        "artifact_preset",
        "signer",
        "created",
    ):
        typer.echo(f"  {k:15} {m.get(k)}")
    for e in m.get("members", []) if isinstance(m.get("members"), list) else []:
        if isinstance(e, dict):
            typer.echo(
                f"  member {e.get('name')} {e.get('size')} bytes sha256 {str(e.get('sha256'))[:16]}..."
            )


@image_app.command("flash")
def flash(
    image: Path = typer.Argument(..., help="Image file."),
    device: Path = typer.Option(..., "--device", help="The board's storage directory."),
    pubkey: list[Path] = typer.Option(
        [],
        "--pubkey",
        help="Trusted public key (provisions a new device); "
        "on a provisioned device it must already be trusted.",
    ),
    allow_downgrade: bool = typer.Option(False, "--allow-downgrade", help="Allow an older semantic version."),
    trials: int = typer.Option(3, "--trials", min=1, max=100, help="Boot attempts before falling back."),
) -> None:
    """Verify the image, write it to the inactive slot, switch to it for a trial boot."""
    import time

    from firmware.device import flash as _flash

    t0 = time.perf_counter()
    r = _flash(image, device, list(pubkey), allow_downgrade=allow_downgrade, trials=trials)
    typer.echo(
        f"flashed version {r['version']} into slot {r['slot']} of {device} "
        f"in {time.perf_counter() - t0:.2f} s; "
        f"it boots on trial ({trials} attempts) at the next `fractal boot`"
    )


@image_app.command("status")
def status(
    device: Path = typer.Option(..., "--device", help="The board's storage directory."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Slots, versions, which slot is active/booted/good, trials left, trusted keys."""
    from firmware.device import SLOTS
    from firmware.device import status as _status

    s = _status(device)
    if as_json:
        typer.echo(json.dumps(s, indent=2, sort_keys=True))
        return
    typer.echo(
        f"device {device}: board {s['board']}, active {s['active']}, previous {s['previous']}, "
        f"booted {s['booted']}, trials left {s['trials_left']}, rollback floor {s['rollback_floor']}"
    )
    if s.get("halt"):
        typer.echo(f"  NO BOOTABLE SLOT: {s['halt']} (flash a current image)")
    for name in SLOTS:
        r = s["slots"][name]
        mark = "*" if name == s["active"] else " "
        ver = f" version {r['version']} ({r.get('artifact')})" if r.get("version") else ""
        chk = (
            ""
            if "verified" not in r
            else (" verified" if r["verified"] else f" NOT VERIFIED: {r.get('problem')}")
        )
        pending = f" (will trust key(s) {', '.join(r['pending_key_ids'])} once good)" if r.get(
            "pending_key_ids") else ""
        typer.echo(f" {mark} slot {name}: {r['state']}{ver}{chk}{pending}")
    typer.echo(f"  trusted keys: {', '.join(s['trusted_keys'])}")


@image_app.command("rollback")
def rollback(device: Path = typer.Option(..., "--device", help="The board's storage directory.")) -> None:
    """Switch back to the previous good slot (takes effect at the next boot)."""
    from firmware.device import rollback as _rollback

    r = _rollback(device)
    typer.echo(f"rolled back: slot {r['slot']} (version {r['version']}) boots next")


@image_app.command("stage")
def stage(
    url: str = typer.Argument(..., help="Image URL, e.g. FLEET/api/images/ID."),
    device: Path = typer.Option(..., "--device", help="The board's storage directory (already provisioned)."),
    token: str = typer.Option("", "--token", envvar="FRACTAL_FLEET_TOKEN", help="Fleet operator token."),
    allow_downgrade: bool = typer.Option(False, "--allow-downgrade", help="Allow an older semantic version."),
) -> None:
    """Download an image (resuming after cuts with range requests) and flash it into the inactive slot."""
    from firmware.ota import stage as _stage

    stats, r = _stage(url, device, token=token or None, allow_downgrade=allow_downgrade)
    typer.echo(
        f"downloaded {stats.size} bytes in {stats.requests} request(s) ({stats.resumed} resumed); "
        f"flashed version {r['version']} into slot {r['slot']}; it boots on trial at the next `fractal boot`"
    )



@image_app.command("build-os")
def build_os(
    artifact: Path = typer.Argument(
        ..., help="C-backend artifact directory (`fractal compile --target x86_64-c|aarch64-c|riscv64`)."
    ),
    board: str = typer.Option(
        ..., "--board", help="Board: x86_64 (UEFI), rpi4, rpi5 (aarch64-c), aarch64-virt or riscv64-virt."
    ),
    key: Path = typer.Option(
        ..., "--key", help="Private release key (`fractal image keygen`); the board trusts its public key."
    ),
    version: str = typer.Option(..., "--version", help="Semantic version of the application, e.g. 1.0.0."),
    out: Path = typer.Option(
        ..., "--out", help="Disk image to write (BOARD.img; .bmap and .sha256 beside it)."
    ),
    rollback_index: int = typer.Option(
        0, "--rollback-index", help="Anti-rollback counter of the application."
    ),
    compress: str = typer.Option(
        "",
        "--compress",
        help="xz or zstd: write BOARD.img.xz / BOARD.img.zst instead of the raw image "
        "(the .bmap describes the raw image; `bmaptool copy` reads the compressed file).",
    ),
) -> None:
    """Build a complete disk image (Debian rootfs, kernel, node, the application in slot a) for a card.

    Boards: x86_64 (UEFI, GPT), rpi4 and rpi5 (MBR, Raspberry Pi firmware), aarch64-virt and
    riscv64-virt (qemu's virt machines)."""
    from firmware.errors import ImageError
    from firmware.osimage.build import build_os as _build_os
    from firmware.osimage.disk import Compression

    try:
        how = Compression(compress) if compress else None
    except ValueError:
        raise ImageError(
            f"unknown compression {compress!r}", hint="use --compress xz or --compress zstd"
        ) from None

    r = _build_os(
        artifact,
        board=board,
        key=key,
        version=version,
        out=out,
        rollback_index=rollback_index,
        compress=how,
        log=lambda m: typer.echo(m, err=True),
    )
    typer.echo(
        f"wrote {r.path} ({r.size // (1 << 20)} MiB raw, {r.stored // (1 << 20)} MiB on disk, "
        f"board {r.board}, version {r.version}), "
        f"{r.bmap.name}, {r.sha256.name} in {r.seconds:.1f} s"
    )


@image_app.command("try")
def try_(
    image: Path = typer.Argument(..., help="Disk image made by `fractal image build-os`."),
    port: int = typer.Option(
        8080, "--port", min=1, max=65535, help="Host port the node's port is forwarded to."
    ),
    ready_timeout: float = typer.Option(
        1200.0, "--ready-timeout", min=1.0, help="Seconds to wait for the node."
    ),
) -> None:
    """Boot the image under qemu-system (console on stderr) and print `node: http://127.0.0.1:PORT` once
    its node is ready; Ctrl-C or SIGTERM stops the machine."""
    import sys

    from api.cli.net import port_problem
    from firmware.osimage.qemu import try_image

    problem = port_problem("127.0.0.1", port)
    if problem:
        from firmware.errors import ImageError

        raise ImageError(problem, hint="pass a free --port")

    import time

    t0 = time.monotonic()

    def ready(url: str) -> None:
        typer.echo(f"node: {url}")
        sys.stdout.flush()
        typer.echo(f"try: the node answered ready {time.monotonic() - t0:.1f} s after qemu started", err=True)

    code = try_image(
        image,
        port=port,
        ready_timeout_s=ready_timeout,
        on_ready=ready,
        console=sys.stderr.fileno(),
        log=lambda m: typer.echo(m, err=True),
    )
    raise typer.Exit(code)


@image_app.command("configure")
def configure(
    image: Path = typer.Argument(..., help="Disk image made by `fractal image build-os`."),
    broker: str = typer.Option(..., "--broker", help="MQTT broker the board joins, e.g. mqtt://10.0.2.2:1883."),
    fleet: str = typer.Option(..., "--fleet", help="Fleet service URL, e.g. http://10.0.2.2:8000."),
    swarm: str = typer.Option(..., "--swarm", help="Swarm id."),
    enroll_token: str = typer.Option(..., "--enroll-token", help="Enrolment token from the fleet."),
    api_token: str = typer.Option("", "--api-token", help="Bearer token the node's HTTP API requires."),
    hostname: str = typer.Option("", "--hostname", help="Host name, also the node id (default fractal-MAC)."),
    ntp_server: str = typer.Option("", "--ntp-server", help="NTP server the board keeps its clock with."),
    wifi_ssid: str = typer.Option("", "--wifi-ssid", help="Wi-Fi network (Raspberry Pi; WPA2-Personal)."),
    wifi_psk: str = typer.Option(
        "", "--wifi-psk", help="Its passphrase (8-63 characters) or 64-hex PSK; stored as the PSK."
    ),
    wifi_country: str = typer.Option("", "--wifi-country", help="Two-letter country code for the radio."),
) -> None:
    """Write first-boot settings (fractal/settings.toml) onto the boot partition (no mount)."""
    from firmware.osimage.settings import SETTINGS_PATH, Settings, configure_image

    s = Settings(
        broker, fleet, swarm, enroll_token, api_token, hostname, ntp_server, wifi_ssid, wifi_psk, wifi_country
    )
    configure_image(image, s)
    wifi = f", Wi-Fi {wifi_ssid!r}" if wifi_ssid else ""
    where = f"the boot partition of {image}"
    typer.echo(f"wrote {SETTINGS_PATH} on {where} (broker {broker}, swarm {swarm}{wifi})")
