"""Logs and the audit trail."""
