"""The host layer: sysfs, cgroups, NUMA, resctrl, and kernel faults."""
