"""The Kubernetes client: pod watch and actions against a fake API server."""
