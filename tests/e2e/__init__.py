"""The whole agent against the runtime simulator and recorded captures."""
