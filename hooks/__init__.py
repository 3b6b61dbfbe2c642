"""Pure per-capability policies: pod + container + config in, desired settings out."""
