"""Background reconciler: node state, the sysfs layer and the loops that keep settings true."""
