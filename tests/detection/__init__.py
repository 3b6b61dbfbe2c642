"""Pressure detection: signals, detectors, smoothing, the detection service."""
