"""Errors a user can act on: the CLI prints them without a traceback."""


class CheckpointError(Exception):
    """A source or output checkpoint is missing, unreadable, corrupt or unsupported."""
