"""The capabilities that turn a policy's decision into an NRI adjustment or a host write."""
