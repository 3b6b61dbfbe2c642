"""Names and defaults of the NRI API that both sides of a connection use."""

from __future__ import annotations

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
"""Served by the plugin on mux connection 1."""
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
"""Served by the runtime on mux connection 2."""
DEFAULT_REQUEST_TIMEOUT_MS = 2000
"""The runtime's request timeout when Configure does not say (NRI before 0.7)."""
DEFAULT_REGISTRATION_TIMEOUT_MS = 5000
"""The runtime's registration timeout when Configure does not say (NRI before 0.7)."""
