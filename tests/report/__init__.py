"""What the agent reports: the status document and the metrics."""
