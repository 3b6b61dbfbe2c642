"""What the agent reports about itself: the status document and socket, the metrics endpoint,
the features a host supports."""
