"""The NRI session: registration, Configure, Synchronize, events and their answers, reconnection."""
