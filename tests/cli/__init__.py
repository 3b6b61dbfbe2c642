"""The command line: ``nri-qos`` commands and the OCI hook binary."""
