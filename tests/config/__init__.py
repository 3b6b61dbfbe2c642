"""The configuration: schema, loading, drop-ins, reload, modes, hostile files."""
