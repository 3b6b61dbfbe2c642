"""Node configuration: frozen dataclasses with documented defaults, loaded from one TOML file."""
