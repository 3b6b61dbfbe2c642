"""Eviction: policy, manager, remote plugins, end to end."""
