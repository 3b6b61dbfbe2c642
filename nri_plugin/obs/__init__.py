"""Observability shared by every layer above the wire: logging setup, log context, audit sinks."""
