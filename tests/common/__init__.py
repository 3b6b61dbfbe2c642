"""The node state and pod metadata shared by the plugin and the reconciler."""
