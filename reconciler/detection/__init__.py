"""Memory interference detection."""
