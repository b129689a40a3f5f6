"""`fractal boot --device PATH`: the board's boot supervisor (see firmware/boot.py)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import FrameType

import typer

from api.cli import app

__all__ = ["boot"]


def _launcher(emulate: str | None):  # -> firmware.boot.Launcher
    from firmware.boot import Launcher

    if emulate is None:
        return Launcher([sys.executable, "-c", "from api.cli import main; main()"])
    from compiler.emulate import sysroot_dir

    if emulate == "riscv64":
        from deploy.riscvnode import riscv_python

        argv, env = riscv_python(sysroot_dir("riscv64"))
    else:
        from deploy.armnode import arm_python

        argv, env = arm_python(sysroot_dir("aarch64"))
    return Launcher(argv, env)


@app.command("boot")
def boot(
    device: Path = typer.Option(..., "--device", help="The board's storage directory."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, help="Port of the node's HTTP API."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the node listens on."),
    node_id: str = typer.Option("", "--node-id", help="Node id (default: the device directory's name)."),
    once: bool = typer.Option(
        False, "--once", help="Stop the node after the health check (install checks, tests)."
    ),
    emulate_arm: bool = typer.Option(
        False, "--emulate-arm", help="Run an aarch64 slot under qemu-user with the sysroot of `make sysroot`."
    ),
    emulate_riscv: bool = typer.Option(
        False, "--emulate-riscv",
        help="Run a riscv64 slot under qemu-user with the sysroot of `make sysroot-riscv64`.",
    ),
    health_timeout: float = typer.Option(
        120.0, "--health-timeout", min=1.0, help="Seconds to wait for readiness."
    ),
    exit_on_reboot: bool = typer.Option(
        False, "--exit-on-reboot",
        help="When the node asks for a reboot, exit with its code (75) instead of booting again "
        "in this process: the board's service reboots the machine (board images).",
    ),
) -> None:
    """Pick the slot, start the node from it, health-check it, mark it good or fall back.

    When the node exits with the reboot code (it staged an image update from the fleet, or
    switched back to its previous slot), boot again instead of exiting (with --exit-on-reboot,
    exit 75 and let the board reboot: a board image's service does). With no slot it may
    start (none verifies or passes its check, or all are below the anti-rollback floor) it
    starts nothing and exits 78; `fractal image status` shows why."""
    from firmware.boot import NO_SLOT_EXIT_CODE, REBOOT_EXIT_CODE
    from firmware.boot import boot as _boot
    from firmware.errors import NoBootableSlot

    if emulate_arm and emulate_riscv:
        from firmware.errors import FirmwareError

        raise FirmwareError("--emulate-arm and --emulate-riscv exclude each other",
                            hint="a board has one architecture: pass the one of the image's board")
    arch = "aarch64" if emulate_arm else "riscv64" if emulate_riscv else None
    current: list = []  # the running node process, for the signal handler
    stopping: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)
        if current and current[0].poll() is None:
            current[0].send_signal(signum)

    if not once:
        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
    while True:
        try:
            r = _boot(
                device,
                _launcher(arch),
                node_id=node_id,
                host=host,
                port=port,
                health_timeout_s=health_timeout,
                log=lambda m: typer.echo(f"boot: {m}", err=True),
            )
        except NoBootableSlot as exc:  # the safe state: nothing runs, `image status` says why
            from api.cli.errors import format_error

            typer.echo(format_error(exc), err=True)
            raise typer.Exit(NO_SLOT_EXIT_CODE) from None
        typer.echo(
            f"booted slot {r.slot} version {r.version}{' (after fallback)' if r.fell_back else ''}: {r.url}"
        )
        sys.stdout.flush()
        if once:
            r.process.terminate()
            r.process.wait(timeout=30)
            return
        current[:] = [r.process]
        if stopping:  # a signal arrived while the slot was being checked
            r.process.send_signal(stopping[0])
        code = r.process.wait()
        if code == REBOOT_EXIT_CODE and not stopping and exit_on_reboot:
            typer.echo("boot: the node asked for a reboot (a new slot is staged); exiting for it", err=True)
            raise typer.Exit(REBOOT_EXIT_CODE)
        if code == REBOOT_EXIT_CODE and not stopping:
            typer.echo("boot: the node asked for a reboot (a new slot is staged); booting again", err=True)
            continue
        raise typer.Exit(code if code >= 0 else 128 - code)
