"""The reconciler's periodic loops; :mod:`.base` runs them, one module per loop."""
