"""nri-qos: containerd NRI plugin for colocating online and offline workloads."""
