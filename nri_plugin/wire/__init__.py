"""The wire layer: mux framing, ttrpc, the NRI messages and what each runtime version speaks.

Nothing here knows the plugin's policies; all wire errors live in :mod:`nri_plugin.wire.errors`.
"""
