"""Configs and launchers: Mosquitto configs, systemd units, key provisioning (:mod:`deploy.keys`),
simulated sensors (:mod:`deploy.sensors`), the demo swarm launcher (:mod:`deploy.swarm`) and the
qemu-user Python finders of emulated nodes (:mod:`deploy.armnode`, :mod:`deploy.riscvnode`).

Layer: above edgenode, below the apps in ``api/``: nothing here imports ``api`` (the CLI hands the
demo swarm its fleet service, see :func:`deploy.swarm.run_swarm`); nodes and the fleet run as
processes started by command line, never as imports.
"""
