"""The fault and soak harness: what tests and ``make soak`` use to hurt a swarm on purpose.

* :mod:`harness.netns`: a three-host network of Linux network namespaces (root only).
* :mod:`harness.faultproxy`: a TCP fault proxy (delay, cut, partition, periodic drops).
* :mod:`harness.netswarm`: a swarm on that network with the fleet's real round manager;
  ``python -m harness.netswarm bench`` measures rounds under faults.
* :mod:`harness.soak`: ``make soak``, rounds for a bounded time under crashes and junk traffic.

Layer: above the apps (it drives the fleet's round manager and node processes) and the
benchmarks; the CLI never imports it. Nothing in production imports it either.
"""

__all__ = ["faultproxy", "netns", "netswarm", "soak"]
