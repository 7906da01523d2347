"""The reference scheduler's one error type for bad configurations."""


class ConfigProblem(ValueError):
    """An impossible or malformed configuration (the CLI exits 2 with this one-line message)."""
