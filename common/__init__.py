"""What the NRI plugin and the reconciler share: the audit catalogue, the metrics registry, the
asyncio toolkit, the node state."""
