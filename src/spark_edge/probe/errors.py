"""Errors a user can act on: the CLI prints them without a traceback."""


class UnsupportedHostError(Exception):
    """This CPU cannot run vLLM's CPU kernels, or not the weight path or image asked for.

    The message names what is missing and what to do instead.
    """
