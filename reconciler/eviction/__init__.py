"""Eviction through the Kubernetes API."""
