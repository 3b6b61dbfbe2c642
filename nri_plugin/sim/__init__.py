"""The runtime simulator and its scenarios (``nri-qos simulate`` and the tests play runtimes
with it)."""
