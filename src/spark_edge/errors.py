"""Errors a user can act on, each with the README's exit code: the one place a refusal becomes a code
(planning's PlanRefused, exit 5, lives beside the plan it carries).

The command group (cli) prints any of them as one line on stderr, without a traceback, and exits with
its `exit_code`; a supervisor (Docker's restart policy, Kubernetes) can then tell a refusal that a retry
will not fix from a crash.
"""

from __future__ import annotations

from typing import ClassVar

from spark_edge import exit_codes


class SparkEdgeError(Exception):
    exit_code: ClassVar[int] = exit_codes.FAILURE


class CheckpointError(SparkEdgeError):
    """A source or output checkpoint is missing, unreadable, corrupt or unsupported."""

    exit_code = exit_codes.CHECKPOINT


class InputFileError(SparkEdgeError):
    """A file named by a vLLM option is missing, unreadable or malformed (exit 3, like a bad checkpoint)."""

    exit_code = exit_codes.CHECKPOINT


class SettingRefused(SparkEdgeError):
    """A setting this model cannot run with (exit 2, like a bad flag); the message says which and why."""

    exit_code = exit_codes.USAGE


class UnsupportedHostError(SparkEdgeError):
    """This CPU cannot run vLLM's CPU kernels, or not the weight path or image asked for.

    The message names what is missing and what to do instead.
    """

    exit_code = exit_codes.UNSUPPORTED_HOST


class PeerUnavailable(SparkEdgeError):
    """The bench's peer could not be built or converted; the message is one line naming the cause and the log.

    spark-edge's own arms are measured before the command exits with it.
    """

    exit_code = exit_codes.PEER


# vLLM 0.32's words when its engine-core process ends before it is ready (vllm/v1/engine/utils.py); the single
# layout's in-process engine says the same (runtime/inproc_engine.py), and serve maps either to EngineDied
ENGINE_START_FAILED = "Engine core initialization failed"


class EngineDied(SparkEdgeError):
    """The engine process died while starting or serving (the OOM killer's SIGKILL, a crash): the server must
    exit non-zero."""

    exit_code = exit_codes.ENGINE_DIED
