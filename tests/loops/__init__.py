"""The reconciler's loops and their runner."""
