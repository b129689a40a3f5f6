"""Sensor streams into the sample store: payload formats, windows, the MQTT subscription."""

from edgenode.streams.window import Outcome, Window, Windower, WindowSpec

__all__ = ["Outcome", "Window", "Windower", "WindowSpec"]
