"""spark-edge: a containerized edge-serving distribution of vLLM for CPUs."""

__version__ = "0.1.0"
