"""Errors quamba raises for bad input: each carries a one-line message meant for the user."""


class QuambaError(Exception):
    """Base class; the CLI prints the message on one line and exits with status 2."""


class ModelNotFoundError(QuambaError, FileNotFoundError):
    """The model name or path names nothing that exists."""


class CheckpointError(QuambaError):
    """A checkpoint that exists but cannot be used (layout, missing or malformed tensors)."""
