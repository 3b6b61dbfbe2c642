"""The NRI session: the stub that registers, configures and dispatches, Synchronize, the
event handler, and the capability chain with its answer and failure policy."""
