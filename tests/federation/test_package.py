"""The package's public surface: every name in ``__all__`` resolves, MQTT names lazily."""

from __future__ import annotations

import subprocess
import sys

import federation


def test_every_public_name_resolves() -> None:
    from federation.broker import start_mosquitto
    from federation.membership import Membership
    from federation.mqtt import MqttLink

    for name in federation.__all__:
        assert getattr(federation, name) is not None, name
    assert federation.MqttLink is MqttLink
    assert federation.Membership is Membership
    assert federation.start_mosquitto is start_mosquitto


def test_import_federation_does_not_load_paho() -> None:
    code = "import sys, federation; print('paho.mqtt.client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    code = "import sys, federation; federation.MqttLink; print('paho.mqtt.client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
