"""A three-host network made of Linux network namespaces (root only; iproute2).

::

    [broker host] b0 10.77.1.1 ==veth== r1 10.77.1.2 [router] r2 10.77.2.2 ==veth== n0 10.77.2.1 [nodes]
     mosquitto :1883                  fault proxies :2000+k -> 10.77.1.1:1883       fractal node x N

The router runs one :class:`harness.faultproxy.ProxyThread` per node (node ``k`` connects to
``10.77.2.2:2000+k``), so a fault can hit one node or all of them. There is no IP forwarding:
the only path between the hosts is the proxy, and no address is added outside the namespaces
the topology creates. Namespace names carry the creating pid; :func:`sweep_stale` removes those
of dead test processes, :meth:`NetTopology.destroy` removes ours (also on failure).

Code in this process reaches a namespace through :meth:`NetTopology.call` (a short thread that
``setns``-es first: sockets it creates, and threads it starts, e.g. paho's network thread, stay
in that namespace); processes start there through ``ip netns exec``.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

BROKER_IP, ROUTER_B_IP, ROUTER_N_IP, NODES_IP = "10.77.1.1", "10.77.1.2", "10.77.2.2", "10.77.2.1"
BROKER_PORT = 1883
_PREFIX = "fxnet"
_CLONE_NEWNET = 0x40000000

__all__ = ["NetTopology", "enter_netns", "sweep_stale", "BROKER_IP", "BROKER_PORT", "ROUTER_N_IP", "NODES_IP"]


def enter_netns(name: str) -> None:
    """Move the CALLING THREAD into network namespace ``/run/netns/NAME`` (needs root).

    Sockets the thread creates afterwards, and threads or processes it starts, live there.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def sweep_stale() -> None:
    """Delete ``fxnet-PID-*`` namespaces whose creating process is gone (a killed earlier run)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for name in re.findall(rf"^({_PREFIX}-(\d+)-\w+)", out, flags=re.M):
        ns, pid = name
        if not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)


class NetTopology:
    """broker host / router / nodes host namespaces joined by two veth pairs."""

    def __init__(self, tag: str = "t") -> None:
        base = f"{_PREFIX}-{os.getpid()}-{tag}"
        self.broker, self.router, self.nodes = f"{base}b", f"{base}r", f"{base}n"
        self._made: list[str] = []

    def create(self) -> NetTopology:
        try:
            for ns in (self.broker, self.router, self.nodes):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            # both ends are created directly inside their namespaces: nothing appears in the host's
            for ns, dev, peer in ((self.broker, "b0", "r1"), (self.nodes, "n0", "r2")):
                _ip("link", "add", dev, "netns", ns, "type", "veth",
                    "peer", "name", peer, "netns", self.router)
            for ns, dev, addr in ((self.broker, "b0", BROKER_IP), (self.router, "r1", ROUTER_B_IP),
                                  (self.router, "r2", ROUTER_N_IP), (self.nodes, "n0", NODES_IP)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def destroy(self) -> None:
        """Delete the namespaces (their veths and any socket left in them go too)."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        self._made.clear()

    def call(self, ns: str, fn: Callable[..., T], *args: Any, timeout: float = 120.0, **kw: Any) -> T:
        """Run ``fn(*args, **kw)`` on a fresh thread inside namespace ``ns``; return its result."""
        box: list[Any] = []

        def run() -> None:
            try:
                enter_netns(ns)
                box.append((True, fn(*args, **kw)))
            except BaseException as exc:  # re-raised in the caller
                box.append((False, exc))

        t = threading.Thread(target=run, name=f"in-{ns}", daemon=True)
        t.start()
        t.join(timeout)
        if not box:
            raise TimeoutError(f"{fn!r} in {ns} did not return within {timeout}s")
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def popen(self, ns: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``ns`` (``ip netns exec`` execs it: the pid is the program's)."""
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)

    def __enter__(self) -> NetTopology:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
