"""Mitigation: the ladder and its actions."""
