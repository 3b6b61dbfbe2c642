"""The pure policies of ``hooks/``: QoS levels, memory QoS, oom scores, resctrl, OCI hooks."""
