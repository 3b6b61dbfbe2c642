"""The deployment manifests checked against the code."""
