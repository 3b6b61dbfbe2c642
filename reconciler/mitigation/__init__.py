"""The mitigation ladder."""
